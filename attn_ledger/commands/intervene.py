"""``attn-ledger intervene``: change only the future, rerun, and see whether the past moved."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from attn_ledger.commands.common import Format, Progress, execute


def intervene(
    config: Annotated[Optional[Path], typer.Argument(help="TOML or JSON config for the built-in pipeline; omitted: the embedded default.")] = None,
    module: Annotated[Optional[str], typer.Option("--module", help="Test your module instead: path/to/file.py:FACTORY or pkg.mod:FACTORY, called as FACTORY(embed_dim, num_heads).")] = None,
    embed_dim: Annotated[Optional[int], typer.Option("--embed-dim", help="E (required with --module).")] = None,
    heads: Annotated[Optional[int], typer.Option("--heads", help="Nh (required with --module).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="T, at least 2.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="B.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seeds the weights, the input and the replacement values.")] = None,
    at: Annotated[Optional[int], typer.Option("--at", help="Test one cut i (0..T-2) instead of all of them.")] = None,
    controls: Annotated[bool, typer.Option("--controls/--no-controls", help="Also run the two leaking controls on the built-in pipeline.")] = True,
    output_format: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.table,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file.")] = None,
) -> None:
    """Test causality by intervention: for each cut i, change only positions after i and rerun.

    Passes only if outputs at 0..i do not move (within the dtype's tolerance) while
    outputs after i clearly do, under no_grad and with autograd on. Two controls (masking
    off, mask in the wrong polarity) must fail, or the test has no power. Also reports
    whether two eval-mode calls agree bitwise.
    """

    def build() -> Any:
        from attn_ledger.experiments.intervene import run_intervene

        overrides = {"embed_dim": embed_dim, "num_heads": heads, "seq_len": seq_len, "batch_size": batch_size, "seed": seed}
        with Progress("intervening") as bar:
            return run_intervene(config, module_spec=module, overrides=overrides, at=at, with_controls=controls,
                                 progress=bar)

    execute(build, output_format, output, command="intervene")
