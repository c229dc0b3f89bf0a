"""``attn-ledger faults``: run the built-in catalogue of broken kernels and modules through ``check``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, execute
from attn_ledger.commands.options import INT


def faults(
    seed: Annotated[Optional[str], typer.Option("--seed", metavar=INT, help="Seed for the random inputs and perturbations, 0..2^63-1. Default: 0.")] = None,
    output_format: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.table,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file.")] = None,
    timings: Annotated[bool, typer.Option("--timings", help="Add the elapsed time to the report (JSON details.elapsed_s).")] = False,
) -> None:
    """Run every catalogued fault through check; show the first level that sees each one.

    Exit 0 when every fault is detected, 1 when any goes undetected (a self-test of the tool).
    """

    def build():
        from attn_ledger.catalogue import run_catalogue

        with Progress("running the fault catalogue") as bar:
            return run_catalogue(seed=opt.seed(seed) or 0, progress=bar)

    execute(build, output_format, output, command="faults", timings=timings)
