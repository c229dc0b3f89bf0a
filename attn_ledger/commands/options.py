"""Option values parsed strictly, the same way in every command.

Integer options are taken as text and parsed here rather than by click, so that only ASCII
digits count (``int("５")`` is 5 in Python, and click would accept it), a value is never
converted when it is absurdly long, and a refusal is the tool's own one-line message naming
the option, the value and the range. Sizes have no cap here beyond their digit count: the
memory estimate bounds them (:mod:`attn_ledger.inputs.limits`). Also here: the memory guard every
command that allocates from user sizes runs before it starts, and the options many commands
take (``--format``, ``--output``, ``--seed``, ``--device``, ``--timeout``), declared once.
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from attn_ledger.commands.common import Format
from attn_ledger.inputs.limits import MAX_INT_DIGITS as MAX_DIGITS  # torch-free, like everything --help imports

INT = "<int>"  # metavar of the integer options, as the help shows click's own integers
_INTEGER = re.compile(r"[+-]?[0-9]+")


def choices(name: str, *values: str) -> Any:
    """A ``str`` enum of ``values``, each member named as its value: the choices of one option."""
    return Enum(name, {v: v for v in values}, type=str)


def integer(text: str | None, option: str, lo: int | None = None, hi: int | None = None) -> int | None:
    """``text`` as an integer in ``lo..hi`` (either end open when None), or None when not given.

    Raises:
        InputError: one line naming the option, the value (cut to a readable length) and the range.
    """
    from attn_ledger.errors import InputError, shown

    if text is None:
        return None
    stripped = text.strip()
    if not _INTEGER.fullmatch(stripped) or len(stripped) > MAX_DIGITS + 1:
        raise InputError(f"{option}: got {shown(text)}, expected {_range(lo, hi)} written in ASCII digits")
    value = int(stripped)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InputError(f"{option}: got {value}, expected {_range(lo, hi)}")
    return value


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"a whole number from {lo} to {hi}"
    if lo is not None:
        return f"a whole number of at least {lo}"
    if hi is not None:
        return f"a whole number of at most {hi}"
    return "a whole number"


def model_source(target: str | None, transformers: str | None) -> tuple[str, str]:
    """``(kind, source)`` of the model a command runs: a ``FILE:FACTORY`` target or ``--transformers``, exactly one.

    Raises:
        InputError: both or neither.
    """
    from attn_ledger.errors import InputError

    if (target is None) == (transformers is None):
        raise InputError("target: expected exactly one of a model 'file.py:FACTORY' or --transformers MODEL_TYPE|config.json")
    return ("transformers", str(transformers)) if transformers is not None else ("factory", str(target))


def seed(text: str | None, option: str = "--seed") -> int | None:
    """A seed: 0..2**63-1."""
    from attn_ledger.seeding import SEED_MAX

    return integer(text, option, 0, SEED_MAX)


def int_list(text: str | None, option: str, lo: int = 0, max_items: int = 1 << 16) -> list[int] | None:
    """Comma-separated integers (``"5,3"``); an empty string is an empty list (batch 0)."""
    from attn_ledger.errors import InputError, shown

    if text is None:
        return None
    if text.count(",") >= max_items:
        raise InputError(f"{option}: got {text.count(',') + 1} values, expected at most {max_items}")
    parts = [p for p in text.split(",")]
    if len(parts) == 1 and parts[0].strip() == "":
        return []
    values = []
    for part in parts:
        if not _INTEGER.fullmatch(part.strip()) or len(part.strip()) > MAX_DIGITS:
            raise InputError(f"{option}: got {shown(text)}, expected comma-separated whole numbers in ASCII digits, "
                             "such as 5,3")
        values.append(int(part.strip()))
    bad = [v for v in values if v < lo]
    if bad:
        raise InputError(f"{option}: got {bad[0]} in {shown(text)}, expected whole numbers of at least {lo}")
    return values


def memory(text: str | None) -> int | None:
    """``--max-memory``: bytes, or None when not given."""
    if text is None:
        return None
    from attn_ledger.inputs.limits import parse_size

    return parse_size(text, "--max-memory")


def refuse_given(given: dict[str, Any], context: str) -> None:
    """Options the chosen mode does not use are an error, not silently ignored.

    Args:
        given: option name -> the value given, or None when it was not given.
        context: the mode and why, as it reads after "expected no OPTION" (``"with --tensors (...)"``).
    """
    from attn_ledger.errors import InputError, shown

    for option, value in given.items():
        if value is not None:
            raise InputError(f"{option}: got {shown(value)}, expected no {option} {context}")


def guard(estimate: Any, max_memory: int | None, say: Any = None, progress: Any = None) -> None:
    """Refuse a request that will not fit (exit 2); announce on stderr one that is large.

    Args:
        estimate: a :class:`attn_ledger.inputs.limits.Estimate`, or None when the sizes are not known yet.
        say: prints one line on stderr (default: the commands' stderr console).
        progress: the command's :class:`~attn_ledger.commands.common.Progress`; for an announced
            request it shows from the first report on, without its usual one-second wait.
    """
    if estimate is None:
        return
    from attn_ledger.inputs import limits

    room = limits.require_fits(estimate, max_memory)
    line = limits.announcement(estimate, room)
    if line is not None:
        if progress is not None:
            progress.delay_s = 0.0
        if say is None:
            from attn_ledger.commands.common import stderr_console

            stderr_console().print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            say(line)


# --- options many commands take, declared once -------------------------------------------------
# Each is the ``Annotated`` type of a command's parameter (``output: opt.OutputOption = None``). Where
# what the option does differs between commands, the command makes its alias with its own help text
# (``SeedOption = opt.seed_option("Seed for ...")``) and its parameter reads ``seed: SeedOption = None``.

OUTPUT_HELP = "Write the report to this file."

FormatOption = Annotated[Format, typer.Option("--format", help="Output format.")]
"""``--format``: how the report is written (default ``Format.table``)."""

DetailOption = Annotated[bool, typer.Option("--detail", "-v", help="Tables list every check of every row with its value (default: a verdict, one line per row, the failing row expanded).")]
"""``--detail``/``-v``: the full table; other formats carry everything either way."""

Device = choices("Device", "cpu", "cuda", "mps", "auto")  # where the work runs


def output_option(help: str = OUTPUT_HELP) -> Any:
    """``--output``/``-o``: the file the report is written to (stdout when not given)."""
    return Annotated[Optional[Path], typer.Option("--output", "-o", help=help)]


OutputOption = output_option()


def seed_option(help: str) -> Any:
    """``--seed``, taken as text and parsed by :func:`seed`; ``help`` says what it seeds and its default."""
    return Annotated[Optional[str], typer.Option("--seed", metavar=INT, help=help)]


def device_option(help: str, any_name: bool = False) -> Any:
    """``--device``: one of :data:`Device`, or with ``any_name`` any text (``cuda:1``) that the config validates."""
    return Annotated[Optional[str] if any_name else Optional[Device], typer.Option("--device", help=help)]


def switch_option(flags: str, help: str, panel: str | None = None) -> Any:
    """An on/off option, ``--name/--no-name``, left None when not given (so that a declaration read from
    ``pyproject.toml`` can fill it in)."""
    return Annotated[Optional[bool], typer.Option(flags, help=help, rich_help_panel=panel)]


def timeout_option(help: str) -> Any:
    """``--timeout SECONDS``: the limit on each call into the user's code."""
    return Annotated[Optional[float], typer.Option("--timeout", metavar="SECONDS", help=help)]


def in_process_option(help: str) -> Any:
    """``--in-process``: the user's code runs in the tool's own process (for debugging), not in a worker."""
    return Annotated[bool, typer.Option("--in-process", help=help)]


def html_option(help: str) -> Any:
    """``--html FILE``: the report also written as one self-contained HTML page; ``help`` says what the page shows."""
    return Annotated[Optional[Path], typer.Option("--html", help=help)]


# --- a transformers model built from its config (``scan``, ``compare``) ------------------------
# The options that name the model and how its attention is registered sit in one help panel, the
# sizes of its inputs in another; each command gives its own help text.

MODEL_PANEL = "Model"
INPUTS_PANEL = "Inputs"

BatchOption = Annotated[Optional[str], typer.Option("--batch", metavar=INT, rich_help_panel=INPUTS_PANEL, help="B, examples in the batch. Default: 2.")]
"""``--batch``: B, taken as text and parsed by :func:`integer`."""


def target_argument(help: str) -> Any:
    """``TARGET``: a model of one's own, ``path/to/file.py:FACTORY`` (or ``--transformers``: :func:`model_source`)."""
    return Annotated[Optional[str], typer.Argument(help=help)]


def transformers_option(help: str) -> Any:
    """``--transformers MODEL_TYPE|config.json``: a transformers model built from its config."""
    return Annotated[Optional[str], typer.Option("--transformers", metavar="MODEL_TYPE|config.json",
                                                 rich_help_panel=MODEL_PANEL, help=help)]


def set_option(help: str) -> Any:
    """``--set KEY=VALUE`` (repeatable): a config value overridden."""
    return Annotated[Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", rich_help_panel=MODEL_PANEL, help=help)]


def attn_implementation_option(help: str) -> Any:
    """``--attn-implementation NAME``: transformers' attention implementation."""
    return Annotated[Optional[str], typer.Option("--attn-implementation", metavar="NAME", rich_help_panel=MODEL_PANEL, help=help)]


def register_option(help: str) -> Any:
    """``--register FILE:FN``: a function registered in transformers' AttentionInterface."""
    return Annotated[Optional[str], typer.Option("--register", metavar="FILE:FN", rich_help_panel=MODEL_PANEL, help=help)]


def mask_format_option(formats: Any, help: str) -> Any:
    """``--mask-format``: one of ``formats`` (a :func:`choices` enum), the mask function registered with ``--register``."""
    return Annotated[Optional[formats], typer.Option("--mask-format", rich_help_panel=MODEL_PANEL, help=help)]
