"""The ``attn-ledger`` command line: options in, library call, rendered report out.

This module and the command modules import neither torch nor the library at top
level, so ``attn-ledger --help`` answers without loading torch.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from attn_ledger._version import __version__

app = typer.Typer(
    name="attn-ledger",
    help=(
        "Diagnose attention code that runs but is wrong. Runs attention as named stages "
        "(split, scores, mask, softmax, mix, merge), checks shape, axis semantics, numerical "
        "invariants and behaviour at each, and names the first stage that diverges.\n\n"
        "Exit status: 0 all that was asked holds; 1 a finding; 2 bad input, usage or setup."
    ),
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attn-ledger {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    pass


from attn_ledger.commands import run as _run  # noqa: E402

app.command("run")(_run.run)

from attn_ledger.commands import intervene as _intervene  # noqa: E402

app.command("intervene")(_intervene.intervene)

from attn_ledger.commands import polarity as _polarity  # noqa: E402
from attn_ledger.commands import sweep_scale as _sweep_scale  # noqa: E402

app.command("sweep-scale")(_sweep_scale.sweep_scale)
app.command("polarity")(_polarity.polarity)

from attn_ledger.commands import check as _check  # noqa: E402
from attn_ledger.commands import faults as _faults  # noqa: E402

app.command("check")(_check.check)
app.command("faults")(_faults.faults)


def main() -> None:
    app()
