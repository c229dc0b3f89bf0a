"""``attn-ledger compare``: two runs of one model, layer by layer, and the first block that adds error."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, execute, spec_path
from attn_ledger.commands.options import INPUTS_PANEL, INT, MODEL_PANEL

Padding = opt.choices("ComparePadding", "none", "left", "right")
MaskFormat = opt.choices("CompareMaskFormat", "sdpa", "eager", "none")
Dtype = opt.choices("CompareDtype", "float32", "bfloat16", "float16", "float64")

TargetArgument = opt.target_argument("Run A as a model of your own: 'path/to/file.py:FACTORY', FACTORY() -> a "
                                     "transformers model (its config makes the tokens). Give this or --transformers.")
TransformersOption = opt.transformers_option(
    "A transformers model built from its config with random weights (never downloaded): a model type (llama, mistral, "
    "gemma2, ...) gets small defaults; a config.json keeps its sizes.")
SetOption = opt.set_option("Override a config value (repeatable), e.g. --set num_hidden_layers=4.")
ImplementationOption = opt.attn_implementation_option("Both runs' attention implementation, where it is not what --vary changes.")
RegisterOption = opt.register_option("Register FN(module, query, key, value, attention_mask, ...) in transformers' "
                                    "AttentionInterface under the name of your own that --vary (or --attn-implementation) gives.")
MaskFormatOption = opt.mask_format_option(MaskFormat, "The mask function registered with --register: sdpa, eager, or none. Default: sdpa.")
SeedOption = opt.seed_option("Seed for the random weights and the token ids, 0..2^63-1. Default: 0.")
MapOption = Annotated[Optional[str], typer.Option(
    "--map", metavar="FILE:FN", rich_help_panel=MODEL_PANEL,
    help="With --vary target: FN(name) gives B's name of each of A's weights (state-dict names) and blocks (module "
         "paths), e.g. model.layers.0.self_attn.q_proj.weight -> blocks.0.attn.wq.weight. Without it, B names them "
         "as A does.")]
TimeoutOption = opt.timeout_option(
    "Limit on each call into the models (building them, the forwards), in seconds. Default 60; with --in-process, "
    "none unless given.")


def compare(  # long by its options (typer reads them from the signature); the body hands them to compare_args
    vary: Annotated[
        str,
        typer.Option("--vary", metavar="WHAT",
                     help="What differs between run A and run B: attn-implementation=A,B (eager, sdpa, "
                          "flex_attention, or the name given with --register), dtype=A,B (float32, bfloat16, "
                          "float16, float64), padding-side (left against right, positions aligned), batch (run A: "
                          "each example alone, one forward each; run B: the batch), cache (run A: the full "
                          "forward; run B: a prefill, then the last tokens decoded one at a time through the "
                          "model's own cache; decoders only), packing (run A: each sequence apart; run B: all "
                          "packed into one row, position ids restarting, no mask; causal decoders only), or "
                          "target=FILE:FACTORY (run B: another model, a port against its reference; A's weights "
                          "copied in by name or through --map)."),
    ],
    target: TargetArgument = None,
    transformers: TransformersOption = None,
    map_: MapOption = None,
    set_: SetOption = None,
    attn_implementation: ImplementationOption = None,
    register: RegisterOption = None,
    mask_format: MaskFormatOption = None,
    dtype: Annotated[Optional[Dtype], typer.Option("--dtype", rich_help_panel=MODEL_PANEL, help="Both runs' dtype, where --vary does not set it. Default: float32.")] = None,
    batch: opt.BatchOption = None,
    seq_len: Annotated[Optional[str], typer.Option("--seq-len", metavar=INT, rich_help_panel=INPUTS_PANEL, help="T, tokens per example. Default: 24.")] = None,
    padding: Annotated[Optional[Padding], typer.Option("--padding", rich_help_panel=INPUTS_PANEL, help="Pad the examples after the first: left (as decoders generate), right or none. Default: left (with --vary padding-side, A is left and B right; --vary cache takes left or none).")] = None,
    seed: SeedOption = None,
    timeout: TimeoutOption = None,
    in_process: opt.in_process_option("Build and run the models in this process, for debugging; without it, they run in a worker process.") = False,
    html: opt.html_option("Also write the report as one self-contained HTML page: a plot of each block's total and added error against its bound, each block opening its stage ledger.") = None,
    output_format: opt.FormatOption = Format.table,
    detail: opt.DetailOption = False,
    output: opt.OutputOption = None,
) -> None:
    """Run one model two ways and compare them block by block: each block's total error (B against A) and the
    error it adds (B's block replayed on A's input, with B's own mask and positions), against a bound that is a
    factor times what a plain computation adds at that block in the runs' dtype (A's block with eager attention,
    against float64). Model-level rows come first (embeddings, masks, position ids and position embeddings as
    the blocks receive them); the logits last, by the same ratio rule and by token agreement (each run's top
    token among the other's top 5). The first block that adds error is the headline. Exit 0 the runs agree, 1 a
    finding, 2 bad input or setup, 3 an internal error.
    """
    def build():
        from attn_ledger.runner.worker import run_user_task, show_output

        args = compare_args(transformers, vary, target=target, overrides=set_, implementation=attn_implementation,
                            register=register, mask_format=mask_format.value if mask_format else None,
                            dtype=dtype.value if dtype else None, batch=batch, seq_len=seq_len,
                            padding=padding.value if padding else None, seed=seed, map_=map_)
        with Progress("comparing") as bar:
            outcome = run_user_task("model_compare", args, in_process=in_process, timeout=timeout, progress=bar)
        show_output(outcome.output)
        return outcome.report

    inputs = {"target": spec_path(target), "--register": spec_path(register), "--map": spec_path(map_),
              "--vary": spec_path(vary.partition("=")[2]) if vary.strip().startswith("target") else None,
              "--transformers": transformers if transformers and transformers.endswith(".json") else None}
    execute(build, output_format, output, command="compare", detail=detail, html=html, inputs=inputs)


def compare_args(transformers: Optional[str], vary: str, *, overrides: Optional[list[str]],
                 implementation: Optional[str], register: Optional[str], mask_format: Optional[str],
                 dtype: Optional[str], batch: Optional[str], seq_len: Optional[str], padding: Optional[str],
                 seed: Optional[str], map_: Optional[str] = None, target: Optional[str] = None) -> dict:
    """The compare task's arguments as plain data, everything that can be validated without the model validated;
    run A is ``--transformers`` or the ``target`` factory, exactly one."""
    from attn_ledger.errors import InputError
    from attn_ledger.probes.model.compare import parse_vary, runs
    from attn_ledger.probes.model.inputs import InputPlan

    kind, source = opt.model_source(target, transformers)
    v = parse_vary(vary)
    if v.kind == "dtype" and dtype is not None:
        raise InputError("--dtype: cannot be given with --vary dtype=A,B")
    seed_value = opt.seed(seed) or 0
    given_padding = padding if padding is not None else ("none" if v.kind == "padding-side" else "left")
    plan = InputPlan(opt.integer(batch, "--batch", 1) or 2, opt.integer(seq_len, "--seq-len", 2) or 24,
                     given_padding, seed_value)
    if v.kind == "padding-side" and padding is not None:
        raise InputError("--padding: cannot be given with --vary padding-side (run A is left padded, run B right)")
    return runs(v, source, kind=kind, overrides=overrides, implementation=implementation, register=register,
                mask_format=mask_format, dtype=dtype or "float32", plan=plan, map=map_).args()
