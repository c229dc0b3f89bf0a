"""``attn-ledger run``: the stage-by-stage ledger on a config or on saved tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attn_ledger.commands.common import Format, execute


def run(
    config: Annotated[Optional[Path], typer.Argument(help="TOML or JSON config; omitted: the embedded default.")] = None,
    output_format: Annotated[Format, typer.Option("--format", help="Output format.")] = Format.table,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to this file.")] = None,
) -> None:
    """Run the attention ledger and name the first stage that diverges."""

    def build():
        from attn_ledger.config import load_config
        from attn_ledger.ledger import run_ledger

        return run_ledger(load_config(config))

    execute(build, output_format, output)
