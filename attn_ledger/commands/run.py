"""``attn-ledger run``: the stage-by-stage ledger on a config or on saved tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, check_clashes, execute
from attn_ledger.commands.options import INT
from attn_ledger.inputs.config import Fault as FaultName
from attn_ledger.inputs.limits import MAX_POSITION


DType = opt.choices("DType", "float32", "float64", "float16", "bfloat16")
InputKind = opt.choices("InputKind", "random", "arange")


# config key -> the option that sets it, so a message about a key names what the user typed
OPTION_NAMES = {"batch_size": "--batch-size", "seq_len": "--seq-len", "query_len": "--query-len", "key_len": "--key-len",
                "embed_dim": "--embed-dim", "num_heads": "--num-heads", "num_kv_heads": "--num-kv-heads",
                "value_dim": "--value-dim", "mask": "--mask", "valid_lengths": "--valid-lengths", "window": "--window",
                "prefix_len": "--prefix-len", "empty_rows": "--empty-rows", "dtype": "--dtype", "seed": "--seed",
                "input": "--input", "device": "--device", "block_size": "--block-size", "keep_grids": "--keep-grids",
                "fault": "--fault", "grad": "--grad", "grad_output": "--grad-output", "replay": "--replay",
                "scale": "--scale", "temperature": "--temperature", "rope": "--rope", "softcap": "--softcap",
                "sinks": "--sinks"}


EmptyRows = opt.choices("EmptyRows", "error", "zeros")
Show = opt.choices("Show", "weights", "mask")  # a heatmap drawn after the table
OutLayout = opt.choices("OutLayout", "bhtd", "bthd")  # a saved out's axes (--tensors)

# the options many commands share, with run's help text
DeviceOption = opt.device_option("cpu, cuda, mps or auto.", any_name=True)  # any name: the config checks cuda:N
OutputOption = opt.output_option("Write the report to this file instead of stdout.")
SeedOption = opt.seed_option("Seed for inputs and weights, 0..2^63-1.")


PICTURE_KEEP = 64  # --show/--html keep whole grids up to this Tq and Tk, the largest the HTML page draws cell by cell


def seed_file(grad_output: str | None) -> str | None:
    """The tensor file a ``grad_output`` value names (None for ``ones``, ``identity`` or nothing)."""
    return None if grad_output in (None, "ones", "identity") else grad_output


def run(  # long by its 37 options (typer reads them from the signature); the body parses them, helpers below run them
    config: Annotated[Optional[Path], typer.Argument(help="TOML or JSON config; omitted: the embedded default (B=2, T=5, E=12, Nh=3, causal).", show_default=False)] = None,
    tensors: Annotated[Optional[Path], typer.Option("--tensors", help="Saved q, k, v (.pt, .safetensors, .npz), with optional allow_mask, key_valid, scores, weights, out, sinks and an additive bias.")] = None,
    fault: Annotated[Optional[FaultName], typer.Option("--fault", help="Inject one deliberate failure into the built-in pipeline.")] = None,
    batch_size: Annotated[Optional[str], typer.Option("--batch-size", metavar=INT, help="B.")] = None,
    seq_len: Annotated[Optional[str], typer.Option("--seq-len", metavar=INT, help="T for self-attention.")] = None,
    query_len: Annotated[Optional[str], typer.Option("--query-len", metavar=INT, help="Tq for cross-attention (with --key-len).")] = None,
    key_len: Annotated[Optional[str], typer.Option("--key-len", metavar=INT, help="Tk for cross-attention (with --query-len).")] = None,
    embed_dim: Annotated[Optional[str], typer.Option("--embed-dim", metavar=INT, help="E.")] = None,
    num_heads: Annotated[Optional[str], typer.Option("--num-heads", "--heads", metavar=INT, help="Nh.")] = None,
    num_kv_heads: Annotated[Optional[str], typer.Option("--num-kv-heads", metavar=INT, help="Nkv for grouped-query attention (divides Nh).")] = None,
    value_dim: Annotated[Optional[str], typer.Option("--value-dim", metavar=INT, help="Dv, the per-head value width (default Dh).")] = None,
    mask: Annotated[Optional[str], typer.Option("--mask", help="Relations joined by '+': none, causal, causal-top-left, padding, sliding-window, prefix-lm, segments.")] = None,
    valid_lengths: Annotated[Optional[str], typer.Option("--valid-lengths", help="Per-example key lengths for padding, e.g. 5,3.")] = None,
    window: Annotated[Optional[str], typer.Option("--window", metavar=INT, help="Window length for sliding-window.")] = None,
    prefix_len: Annotated[Optional[str], typer.Option("--prefix-len", metavar=INT, help="Prefix length for prefix-lm.")] = None,
    empty_rows: Annotated[Optional[EmptyRows], typer.Option("--empty-rows", help="Rows with every key blocked: an error, or declared and required to be zeros.")] = None,
    dtype: Annotated[Optional[DType], typer.Option("--dtype", help="Compute dtype.")] = None,
    seed: SeedOption = None,
    input_kind: Annotated[Optional[InputKind], typer.Option("--input", help="random or arange inputs.")] = None,
    device: DeviceOption = None,
    block_size: Annotated[Optional[str], typer.Option("--block-size", metavar=INT, help="Query rows per block for the score-grid stages.")] = None,
    keep_grids: Annotated[bool, typer.Option("--keep-grids", help="Keep whole score grids in memory even when large.")] = False,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="Evaluate every row after the first divergence (marked downstream).")] = False,
    backends: Annotated[Optional[str], typer.Option("--backends", help="Repeat the context comparison per SDPA backend: 'all' or names from math, flash, efficient, cudnn joined by ','.")] = None,
    output_format: opt.FormatOption = Format.table,
    detail: opt.DetailOption = False,
    output: OutputOption = None,
    show: Annotated[Optional[list[Show]], typer.Option("--show", help="After the table, draw a heatmap per head of the diverging example: the weights, or what masking did (repeatable; up to Tq, Tk = 32 cell by cell, pooled beyond).")] = None,
    html: opt.html_option("Also write the report as one self-contained HTML page, with the mask and weight heatmaps.") = None,
    max_memory: Annotated[Optional[str], typer.Option("--max-memory", metavar="SIZE", help="Memory budget such as 8G or 512M (default: what the machine has free); a run estimated above it is refused.")] = None,
    grad: Annotated[bool, typer.Option("--grad", help="Also run and check the backward stages (grad_context .. grad_k; for configs grad_projections, grad_input).")] = False,
    grad_output: Annotated[Optional[str], typer.Option("--grad-output", help="O-bar seeded on the last forward stage (with --grad): ones (default), identity (I on each head's [Tq, Dv] block; needs Tq == Dv) or a tensor file of that stage's shape.")] = None,
    replay: Annotated[bool, typer.Option("--replay", help="Run the computation twice and check the two bitwise (on output, or context for --tensors; with --grad also on grad_k).")] = False,
    scale: Annotated[Optional[float], typer.Option("--scale", help="Score scale S (default 1/sqrt(Dh)); the pipeline and every reference use S/tau.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Softmax temperature tau: the score scale becomes S/tau.")] = None,
    softcap: Annotated[Optional[float], typer.Option("--softcap", metavar="C", help="Soft-cap the scaled scores, C * tanh(s / C), before the mask (Gemma 2's attn_logit_softcapping), in the pipeline, every reference and the backward (--grad).")] = None,
    sinks: Annotated[Optional[str], typer.Option("--sinks", metavar="S|FILE", help="Attention sinks, one logit per head in the softmax's denominator only (gpt-oss's s_aux): a number for every head, Nh numbers joined by ',', or a tensor file; in the pipeline, every reference and the backward (--grad).")] = None,
    out_layout: Annotated[Optional[OutLayout], typer.Option("--out-layout", help="With --tensors: the saved out is [B, Nh, Tq, Dv] (bhtd, the context's own) or [B, Tq, Nh, Dv] (bthd, as transformers' attention functions return it). Default: bhtd.")] = None,
    rope: Annotated[Optional[str], typer.Option("--rope", help="Rotary positions on q and k before the scores: PAIRING[,base=B][,dim=D], PAIRING half or interleaved (e.g. half, interleaved,base=500000,dim=32).")] = None,
) -> None:
    """Run attention as named stages, check each, and name the first stage that diverges.

    Exit status: 0 no divergence, 1 a divergence, 2 bad input.
    """
    shown = [s.value for s in dict.fromkeys(show or [])]
    pictures = bool(shown) or html is not None

    def build():
        budget = opt.memory(max_memory)
        sizes = _integers({"--batch-size": batch_size, "--seq-len": seq_len, "--query-len": query_len,
                           "--key-len": key_len, "--embed-dim": embed_dim, "--num-heads": num_heads,
                           "--num-kv-heads": num_kv_heads, "--value-dim": value_dim})
        positions = _integers({"--window": window, "--prefix-len": prefix_len, "--block-size": block_size}, hi=MAX_POSITION)
        lengths = opt.int_list(valid_lengths, "--valid-lengths")
        seed_value = opt.seed(seed)
        progress = Progress("ledger blocks")
        if tensors is not None:
            spec = _refuse_for_tensors(config, fault, mask, positions, {**sizes, "--valid-lengths": valid_lengths,
                                                                        "--seed": seed,
                                                                        "--input": input_kind.value if input_kind else None})
            return _on_tensors(
                tensors, budget, progress, mask=spec, window=positions["--window"],
                prefix_len=positions["--prefix-len"], empty_rows=(empty_rows.value if empty_rows else "error"),
                dtype=dtype.value if dtype else None, device=device or "cpu", block_size=positions["--block-size"],
                keep_grids=keep_grids, keep_going=keep_going, backends=backends, scale=scale, temperature=temperature,
                rope=rope, grad=grad, grad_output=grad_output, replay=replay, softcap=softcap, sinks=sinks,
                out_layout=out_layout.value if out_layout else "bhtd")
        if out_layout is not None:
            from attn_ledger.errors import InputError

            raise InputError(f"--out-layout: got {out_layout.value!r} without --tensors, expected it only for a saved out")
        overrides = {
            "fault": fault.value if fault else None, "batch_size": sizes["--batch-size"], "seq_len": sizes["--seq-len"],
            "query_len": sizes["--query-len"], "key_len": sizes["--key-len"], "embed_dim": sizes["--embed-dim"],
            "num_heads": sizes["--num-heads"], "num_kv_heads": sizes["--num-kv-heads"], "value_dim": sizes["--value-dim"],
            "mask": mask, "valid_lengths": lengths, "window": positions["--window"], "prefix_len": positions["--prefix-len"],
            "empty_rows": empty_rows.value if empty_rows else None, "dtype": dtype.value if dtype else None,
            "seed": seed_value, "input": input_kind.value if input_kind else None, "device": device,
            "block_size": positions["--block-size"], "keep_grids": keep_grids or None, "grad": grad or None,
            "grad_output": grad_output, "replay": replay or None, "scale": scale, "temperature": temperature,
            "rope": rope, "softcap": softcap, "sinks": sinks,
        }
        return _on_config(config, overrides, budget, progress, pictures=pictures, outputs={"output": output, "html": html},
                          keep_going=keep_going, backends=backends)

    inputs = {"config": config, "--tensors": tensors, "--grad-output": seed_file(grad_output)}
    from attn_ledger.inputs.sinks import names_file

    if sinks is not None and names_file(sinks):
        inputs["--sinks"] = Path(sinks)
    execute(build, output_format, output, command="run", detail=detail, show=shown, html=html, inputs=inputs)


def _integers(given: dict[str, Optional[str]], hi: Optional[int] = None) -> dict[str, Optional[int]]:
    """Each option's text (``--window`` -> ``"4"``) as a whole number up to ``hi``, None where not given."""
    return {option: opt.integer(text, option, hi=hi) for option, text in given.items()}


def _on_config(config: Optional[Path], overrides: dict[str, Any], budget: Optional[int], progress: Progress, *,
               pictures: bool, outputs: dict[str, Optional[Path]], keep_going: bool, backends: Optional[str]) -> Any:
    """The ledger on a config (or the embedded default) under the options given."""
    from attn_ledger.inputs.config import load_config
    from attn_ledger.ledger import run_ledger
    from attn_ledger.engine.budget import estimate_run

    cfg = load_config(config, overrides, OPTION_NAMES)
    check_clashes(outputs, {"grad_output": seed_file(cfg.grad_output)})
    if pictures and not cfg.keep_grids and max(cfg.tq, cfg.tk) <= PICTURE_KEEP:
        cfg = cfg.model_copy(update={"keep_grids": True})  # the heatmaps draw every cell at this size
    opt.guard(estimate_run(cfg), budget, progress=progress)
    with progress:
        return run_ledger(cfg, keep_going=keep_going, progress=progress, backends=backends)


def _refuse_for_tensors(config: Optional[Path], fault: Optional[FaultName], mask: Optional[str],
                        positions: dict[str, Optional[int]], unused: dict[str, Any]) -> Any:
    """What --tensors cannot take: a config, a fault, the sizes and seeds the file sets, a position its mask lacks.
    Returns the mask's relation (a :class:`~attn_ledger.maths.relations.RelationSpec`): its one parse on this path."""
    from attn_ledger.maths import relations
    from attn_ledger.errors import InputError

    if config is not None:
        raise InputError(f"config: got {str(config)!r} together with --tensors, expected one input or the other")
    if fault is not None:
        raise InputError("fault: got a fault with --tensors, expected faults only for the built-in pipeline")
    opt.refuse_given(unused, "with --tensors (the file sets every size and holds the inputs)")
    spec = relations.parse(mask, relations.TENSOR_RELATIONS)
    for option, relation in (("--window", "sliding-window"), ("--prefix-len", "prefix-lm")):
        if positions[option] is not None and relation not in spec.names:
            raise InputError(f"{option}: got {positions[option]}, expected it only with a mask that includes "
                             f"{relation!r} (the mask is {(mask or 'none')!r})")
    return spec


def _on_tensors(tensors: Path, budget: Optional[int], progress: Progress, **options: Any) -> Any:
    """The ledger on saved tensors; ``options`` are :func:`attn_ledger.ledger.run_ledger_tensors`' own."""
    from attn_ledger.ledger import run_ledger_tensors
    from attn_ledger.engine.budget import estimate_tensors
    from attn_ledger.inputs.tensorio import load_tensor_file

    found = load_tensor_file(tensors, "tensors", max_memory=budget)
    opt.guard(estimate_tensors(found, dtype=options["dtype"], block_size=options["block_size"],
                               keep_grids=options["keep_grids"], mask=options["mask"], grad=options["grad"]),
              budget, progress=progress)
    with progress:
        return run_ledger_tensors(found, progress=progress, source=str(tensors), **options)
