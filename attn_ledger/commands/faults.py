"""``attn-ledger faults``: run the built-in catalogue of broken kernels and modules through ``check``."""

from __future__ import annotations

from typing import Annotated

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, execute


SeedOption = opt.seed_option("Seed for the random inputs and perturbations, 0..2^63-1. Default: 0.")  # check's words


def faults(
    seed: SeedOption = None,
    output_format: opt.FormatOption = Format.table,
    detail: opt.DetailOption = False,
    output: opt.OutputOption = None,
    timings: Annotated[bool, typer.Option("--timings", help="Add the elapsed time to the report (JSON details.elapsed_s).")] = False,
) -> None:
    """Run every catalogued fault through check; show the first level that sees each one.

    Exit 0 when every fault is detected, 1 when any goes undetected (a self-test of the tool).
    """

    def build():
        from attn_ledger.probes.catalogue import run_catalogue

        with Progress("running the fault catalogue") as bar:
            return run_catalogue(seed=opt.seed(seed) or 0, progress=bar)

    execute(build, output_format, output, command="faults", detail=detail, timings=timings)
