"""``attn-ledger sweep-scale``: score spread and softmax sharpness against Dh, raw and scaled."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attn_ledger.commands.common import Format, Progress, execute


def sweep_scale(
    dh: Annotated[str, typer.Option("--dh", help="Comma-separated head widths Dh to sweep.")] = "8,32,128,512",
    queries: Annotated[int, typer.Option("--queries", help="Query vectors Tq per Dh.")] = 512,
    keys: Annotated[int, typer.Option("--keys", help="Key vectors Tk per Dh.")] = 512,
    seed: Annotated[int, typer.Option("--seed", help="Seed for the random q and k.")] = 0,
    tensors: Annotated[
        Optional[Path], typer.Option("--tensors", help="Saved q and k ([B, T, Dh] or [B, Nh, T, Dh]) to measure instead.")
    ] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of std and entropy against Dh (needs matplotlib).")] = None,
    output_format: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.table,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file.")] = None,
) -> None:
    """Does 1/sqrt(Dh) hold the score spread near 1 and the softmax entropy flat across Dh?

    Exit 1 when the relationship fails (sweep) or a saturation/headroom flag is raised (--tensors).
    """

    def build():
        from attn_ledger.experiments.scale import sweep_scale as run_sweep_scale

        with Progress("sweep-scale") as progress:
            return run_sweep_scale(dh, queries, keys, seed, tensors=tensors, plot=plot, progress=progress)

    execute(build, output_format, output, command="sweep-scale")
