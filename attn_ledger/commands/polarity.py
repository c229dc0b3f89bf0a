"""``attn-ledger polarity``: boolean mask conventions per API, probed, and a user's mask fingerprinted."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from attn_ledger.commands import options as opt
from attn_ledger.commands.common import Format, Progress, execute


Expect = opt.choices("Expect", "causal", "padding")  # the relation a mask file should encode
PaddingSide = opt.choices("PaddingSide", "right", "left")  # where padding sits in each row of a [B, Tk] mask

MaskOption = Annotated[Optional[Path], typer.Option("--mask", help="A mask file (.pt, .npz, .safetensors) to fingerprint.")]
ExpectOption = Annotated[Optional[Expect], typer.Option("--expect", help="The relation the mask should encode.")]
PaddingSideOption = Annotated[Optional[PaddingSide], typer.Option(
    "--padding-side", help="Padding side for --expect padding. Default: right.")]


def polarity(
    mask: MaskOption = None,
    expect: ExpectOption = None,
    padding_side: PaddingSideOption = None,
    output_format: opt.FormatOption = Format.table,
    detail: opt.DetailOption = False,
    output: opt.OutputOption = None,
) -> None:
    """Which boolean convention does each attention API use, and what does the wrong one do?

    Exit 1 when a probe and the installed documentation disagree, or a --mask file matches
    neither polarity of the expected relation or is a float 0/1 mask.
    """

    def build():
        from attn_ledger.errors import field_error
        from attn_ledger.experiments.polarity import polarity as run_polarity

        if padding_side is not None and expect is not Expect.padding:  # the side of a padding mask, nothing else
            raise field_error("--padding-side", padding_side.value, "it only with --mask FILE --expect padding")
        with Progress("polarity") as progress:
            return run_polarity(mask, expect.value if expect else None, (padding_side or PaddingSide.right).value,
                                progress=progress)

    execute(build, output_format, output, command="polarity", detail=detail, inputs={"--mask": mask})
