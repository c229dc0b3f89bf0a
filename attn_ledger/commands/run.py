"""``attn-ledger run``: the stage-by-stage ledger on a config or on saved tensors."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from attn_ledger.commands.common import Format, Progress, execute
from attn_ledger.config import Fault as FaultName


class DType(str, Enum):
    float32 = "float32"
    float64 = "float64"
    float16 = "float16"
    bfloat16 = "bfloat16"


class InputKind(str, Enum):
    random = "random"
    arange = "arange"


class EmptyRows(str, Enum):
    error = "error"
    zeros = "zeros"


class Show(str, Enum):
    """A heatmap drawn after the table."""

    weights = "weights"
    mask = "mask"


PICTURE_KEEP = 64  # --show/--html keep whole grids up to this Tq and Tk, the largest the HTML page draws cell by cell


def _int_list(text: str | None, field: str) -> list[int] | None:
    from attn_ledger.errors import InputError

    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"{field}: got {text!r}, expected comma-separated whole numbers such as 3,5") from None


def run(
    config: Annotated[Optional[Path], typer.Argument(help="TOML or JSON config; omitted: the embedded default (B=2, T=5, E=12, Nh=3, causal).", show_default=False)] = None,
    tensors: Annotated[Optional[Path], typer.Option("--tensors", help="Saved q, k, v (.pt, .safetensors, .npz), with optional allow_mask, key_valid, scores, weights, out.")] = None,
    fault: Annotated[Optional[FaultName], typer.Option("--fault", help="Inject one deliberate failure into the built-in pipeline.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="B.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="T for self-attention.")] = None,
    query_len: Annotated[Optional[int], typer.Option("--query-len", help="Tq for cross-attention (with --key-len).")] = None,
    key_len: Annotated[Optional[int], typer.Option("--key-len", help="Tk for cross-attention (with --query-len).")] = None,
    embed_dim: Annotated[Optional[int], typer.Option("--embed-dim", help="E.")] = None,
    num_heads: Annotated[Optional[int], typer.Option("--num-heads", "--heads", help="Nh.")] = None,
    num_kv_heads: Annotated[Optional[int], typer.Option("--num-kv-heads", help="Nkv for grouped-query attention (divides Nh).")] = None,
    value_dim: Annotated[Optional[int], typer.Option("--value-dim", help="Dv, the per-head value width (default Dh).")] = None,
    mask: Annotated[Optional[str], typer.Option("--mask", help="Relations joined by '+': none, causal, causal-top-left, padding, sliding-window, prefix-lm, segments.")] = None,
    valid_lengths: Annotated[Optional[str], typer.Option("--valid-lengths", help="Per-example key lengths for padding, e.g. 5,3.")] = None,
    window: Annotated[Optional[int], typer.Option("--window", help="Window length for sliding-window.")] = None,
    prefix_len: Annotated[Optional[int], typer.Option("--prefix-len", help="Prefix length for prefix-lm.")] = None,
    empty_rows: Annotated[Optional[EmptyRows], typer.Option("--empty-rows", help="Rows with every key blocked: an error, or declared and required to be zeros.")] = None,
    dtype: Annotated[Optional[DType], typer.Option("--dtype", help="Compute dtype.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed for inputs and weights.")] = None,
    input_kind: Annotated[Optional[InputKind], typer.Option("--input", help="random or arange inputs.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, mps or auto.")] = None,
    block_size: Annotated[Optional[int], typer.Option("--block-size", help="Query rows per block for the score-grid stages.")] = None,
    keep_grids: Annotated[bool, typer.Option("--keep-grids", help="Keep whole score grids in memory even when large.")] = False,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="Evaluate every row after the first divergence (marked downstream).")] = False,
    backends: Annotated[Optional[str], typer.Option("--backends", help="Repeat the context comparison per SDPA backend: 'all' or names from math, flash, efficient, cudnn joined by ','.")] = None,
    output_format: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.table,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file instead of stdout.")] = None,
    show: Annotated[Optional[list[Show]], typer.Option("--show", help="After the table, draw a heatmap per head of the diverging example: the weights, or what masking did (repeatable; up to Tq, Tk = 32 cell by cell, pooled beyond).")] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Also write the report as one self-contained HTML page, with the mask and weight heatmaps.")] = None,
    grad: Annotated[bool, typer.Option("--grad", help="Also run and check the backward stages (grad_context .. grad_k; for configs grad_projections, grad_input).")] = False,
    grad_output: Annotated[Optional[str], typer.Option("--grad-output", help="O-bar seeded on the last forward stage (with --grad): ones (default), identity (I on each head's [Tq, Dv] block; needs Tq == Dv) or a tensor file of that stage's shape.")] = None,
    replay: Annotated[bool, typer.Option("--replay", help="Run the computation twice and check the two bitwise (on output, or context for --tensors; with --grad also on grad_k).")] = False,
    scale: Annotated[Optional[float], typer.Option("--scale", help="Score scale S (default 1/sqrt(Dh)); the pipeline and every reference use S/tau.")] = None,
    temperature: Annotated[Optional[float], typer.Option("--temperature", help="Softmax temperature tau: the score scale becomes S/tau.")] = None,
    rope: Annotated[Optional[str], typer.Option("--rope", help="Rotary positions on q and k before the scores: PAIRING[,base=B][,dim=D], PAIRING half or interleaved (e.g. half, interleaved,base=500000,dim=32).")] = None,
) -> None:
    """Run attention as named stages, check each, and name the first stage that diverges.

    Exit status: 0 no divergence, 1 a divergence, 2 bad input.
    """
    shown = [s.value for s in dict.fromkeys(show or [])]
    pictures = bool(shown) or html is not None

    def build():
        from attn_ledger.errors import InputError

        progress = Progress("ledger blocks")
        if tensors is not None:
            from attn_ledger.ledger import run_ledger_tensors

            if config is not None:
                raise InputError(f"config: got {str(config)!r} together with --tensors, expected one input or the other")
            if fault is not None:
                raise InputError("fault: got a fault with --tensors, expected faults only for the built-in pipeline")
            with progress:
                return run_ledger_tensors(
                    str(tensors), mask=mask or "none", window=window, prefix_len=prefix_len,
                    empty_rows=(empty_rows.value if empty_rows else "error"), dtype=dtype.value if dtype else None,
                    device=device or "cpu", block_size=block_size, keep_grids=keep_grids, keep_going=keep_going,
                    progress=progress, backends=backends, scale=scale, temperature=temperature, rope=rope, grad=grad,
                    grad_output=grad_output, replay=replay)
        from attn_ledger.config import load_config
        from attn_ledger.ledger import run_ledger

        overrides = {
            "fault": fault.value if fault else None, "batch_size": batch_size, "seq_len": seq_len,
            "query_len": query_len, "key_len": key_len, "embed_dim": embed_dim, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads, "value_dim": value_dim, "mask": mask,
            "valid_lengths": _int_list(valid_lengths, "valid_lengths"), "window": window, "prefix_len": prefix_len,
            "empty_rows": empty_rows.value if empty_rows else None, "dtype": dtype.value if dtype else None,
            "seed": seed, "input": input_kind.value if input_kind else None, "device": device,
            "block_size": block_size, "keep_grids": keep_grids or None, "grad": grad or None,
            "grad_output": grad_output, "replay": replay or None, "scale": scale, "temperature": temperature,
            "rope": rope,
        }
        cfg = load_config(config, overrides)
        if pictures and not cfg.keep_grids and max(cfg.tq, cfg.tk) <= PICTURE_KEEP:
            cfg = cfg.model_copy(update={"keep_grids": True})  # the heatmaps draw every cell at this size
        with progress:
            return run_ledger(cfg, keep_going=keep_going, progress=progress, backends=backends)

    execute(build, output_format, output, command="run", show=shown, html=html)
