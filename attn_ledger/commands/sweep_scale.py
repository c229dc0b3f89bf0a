"""``attn-ledger sweep-scale``: score spread and softmax sharpness against Dh, raw and scaled; or temperature."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, execute
from attn_ledger.commands.options import INT


SeedOption = opt.seed_option("Seed for the random q and k, 0..2^63-1. Default: 0.")  # sweep-scale's help text


def sweep_scale(
    dh: Annotated[Optional[str], typer.Option("--dh", help="Comma-separated head widths Dh to sweep. Default: 8,32,128,512.")] = None,
    queries: Annotated[Optional[str], typer.Option("--queries", metavar=INT, help="Query vectors Tq per Dh, 2..4096. Default: 512.")] = None,
    keys: Annotated[Optional[str], typer.Option("--keys", metavar=INT, help="Key vectors Tk per Dh, 2..4096. Default: 512.")] = None,
    seed: SeedOption = None,
    tensors: Annotated[
        Optional[Path], typer.Option("--tensors", help="Saved q and k ([B, T, Dh] or [B, Nh, T, Dh]) to measure instead.")
    ] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of std and entropy against Dh (needs matplotlib).")] = None,
    temperatures: Annotated[Optional[str], typer.Option("--temperatures", help="Instead of the Dh sweep: softmax(scores / tau) and its entropy at each temperature tau, e.g. 0.5,1,2.")] = None,
    scores: Annotated[Optional[str], typer.Option("--scores", help="The fixed row of scores for --temperatures. Default: 1.2,0.3,-0.4,1.8.")] = None,
    output_format: opt.FormatOption = Format.table,
    detail: opt.DetailOption = False,
    output: opt.OutputOption = None,
    max_memory: Annotated[Optional[str], typer.Option("--max-memory", metavar="SIZE", help="Memory budget such as 8G or 512M (default: what the machine has free).")] = None,
) -> None:
    """Does 1/sqrt(Dh) hold the score spread near 1 and the softmax entropy flat across Dh?

    With --temperatures: the softmax of one fixed row of scores at each temperature, and its entropy.
    Exit 1 when the relationship fails (sweep), a saturation/headroom flag is raised (--tensors), or a
    distribution disagrees with a float64 softmax of the same scores (--temperatures).
    """

    def build():
        from attn_ledger.errors import InputError
        from attn_ledger.experiments import scale

        if temperatures is not None:
            for option, value in (("--dh", dh), ("--tensors", tensors), ("--queries", queries), ("--keys", keys),
                                  ("--seed", seed), ("--plot", plot), ("--max-memory", max_memory)):
                if value is not None:
                    raise InputError(f"{option}: got {str(value)!r}, expected no {option} with --temperatures "
                                     "(one fixed row of scores, no sweep over Dh)")
            taus = scale.parse_values(temperatures, "--temperatures", positive=True, distinct=True)
            row = scale.DEFAULT_SCORES if scores is None else scale.parse_values(scores, "--scores")
            return scale.temperature_lab(taus, row)
        if scores is not None:
            raise InputError(f"--scores: got {scores!r}, expected it only with --temperatures")
        if tensors is not None:
            opt.refuse_given({"--dh": dh, "--queries": queries, "--keys": keys, "--seed": seed},
                             "with --tensors (the file sets the sizes and holds q and k)")
        tq = opt.integer(queries, "--queries", 2, scale.MAX_T)
        tk = opt.integer(keys, "--keys", 2, scale.MAX_T)
        if plot is not None:
            scale.check_plot_path(plot)
        with Progress("sweep-scale") as progress:
            report = scale.sweep_scale(dh if dh is not None else scale.DEFAULT_DH,
                                       scale.DEFAULT_QUERIES if tq is None else tq, scale.DEFAULT_KEYS if tk is None else tk,
                                       opt.seed(seed) or 0, tensors=tensors, progress=progress,
                                       max_memory=opt.memory(max_memory))
        return report if plot is None else scale.plotted(report, plot)  # execute writes it with the other outputs

    def png(report):
        from attn_ledger.experiments.scale import plot_png

        return plot_png(report)

    execute(build, output_format, output, command="sweep-scale", detail=detail, inputs={"--tensors": tensors}, files={"--plot": (plot, png)})
