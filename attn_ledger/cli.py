"""The ``attn-ledger`` command line: options in, library call, rendered report out.

This module and the command modules import neither torch nor the library at top
level, so ``attn-ledger --help`` answers without loading torch. Usage errors (an unknown
option, a value of the wrong kind, a choice not offered) are one line on stderr with
exit status 2, the same form as every other input error.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Annotated, Any, Optional, Sequence

import typer
from typer.core import TyperCommand, TyperGroup

from attn_ledger._version import __version__

EXIT_HELP = (
    "Exit status: 0 all that was asked holds; 1 a finding (a divergence, a leak, an undetected "
    "fault); 2 bad input, usage or setup; 3 an internal error of the tool (a bug: rerun with "
    "--debug or ATTN_LEDGER_DEBUG=1 for the traceback)."
)


def _value_of(args: Sequence[str], opts: Sequence[str]) -> str | None:
    """The value given on the command line for one of ``opts`` (``--opt V`` or ``--opt=V``)."""
    for i, a in enumerate(args):
        for o in opts:
            if a == o and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(o + "="):
                return a[len(o) + 1:]
    return None


def _short(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[:limit] + f"... ({len(value)} characters)"


_EXPECT = (
    ("valid integer", "a whole number"),
    ("valid number", "a number"),
    ("valid boolean", "true or false"),
)


def usage_line(exc: Any, args: Sequence[str]) -> str:
    """One line for a usage error: the option, the value received and what was expected."""
    from typer._click import exceptions as cx

    message = exc.format_message() if not isinstance(exc, cx.BadParameter) else exc.message
    message = re.sub(r"^Value error, ", "", str(message)).strip()
    if isinstance(exc, cx.BadParameter) and exc.param is not None:
        opts = [o for o in getattr(exc.param, "opts", []) if o.startswith("-")]
        name = max(opts, key=len) if opts else (exc.param.name or "argument")
        value = _value_of(args, opts) if opts else None
        got = f"got {_short(value)!r}, " if value is not None else ""
        m = re.match(r"^(.*) is not one of (.*)\.$", message)
        if m:
            from attn_ledger.errors import did_you_mean

            options = [c.strip().strip("'") for c in m.group(2).split(",")]
            got = m.group(1).strip(chr(39))
            return f"{name}: got {_short(got)!r}, expected one of {', '.join(options)}" + did_you_mean(got, options)
        for needle, expected in _EXPECT:
            if needle in message:
                return f"{name}: {got}expected {expected}"
        return f"{name}: {got}{message}"
    if isinstance(exc, cx.NoSuchOption):
        return f"{exc.option_name}: no such option" + (
            f"; did you mean {', '.join(exc.possibilities)}?" if exc.possibilities else "")
    return _short(message, 300)


LONG_CHOICES = 16  # a choice type longer than this (``<a|b|c>``) is named by a short metavar in --help


@contextlib.contextmanager
def _help_view(params: Sequence[Any], ctx: Any) -> Any:
    """For the terminal help only: no type after a flag (typer would print ``<bool>``), and an option with
    a long list of choices named ``<name>`` with its choices in the help text, which wraps at spaces
    (the type column would cut them mid-word). Everything is put back afterwards."""
    saved = [(p, p.metavar, p.help) for p in params]
    try:
        for p in params:
            if p.metavar is not None or not hasattr(p, "is_flag"):
                continue
            if p.is_flag and not p.count:
                p.metavar = ""
            elif getattr(p, "type_descriptor", None) is not None and p.type_descriptor.is_choice:
                if len(p.display_type_rich(ctx) or "") > LONG_CHOICES:
                    values = [str(getattr(c, "value", c)) for c in p.type_descriptor.choices or ()]
                    p.metavar = f"<{max(p.opts, key=len).lstrip('-')}>"
                    p.help = (p.help or "").rstrip() + f" Choices: {', '.join(values)}."
        yield
    finally:
        for p, metavar, help_text in saved:
            p.metavar, p.help = metavar, help_text


class _Command(TyperCommand):
    """A command whose --help shows flags without a type and long choice lists as text (:func:`_help_view`)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _help_view(self.get_params(ctx), ctx):
            super().format_help(ctx, formatter)
EXIT_TERMINATED = 128 + 15  # as a shell reports a process ended by SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived: unwind like Ctrl-C, so that workers end and temporary files go, then exit 143."""


def _terminate(signum: int, frame: Any) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
    raise Terminated()


class _OneLineErrors(TyperGroup):
    """Usage errors as one line and exit 2, instead of a panel with the usage text."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        import sys

        from typer._click import exceptions as cx
        from typer.exceptions import Abort

        argv = list(sys.argv[1:] if args is None else args)
        if "--debug" in argv[1:]:  # accepted after the command name too
            argv = ["--debug"] + [a for a in argv if a != "--debug"]
        from attn_ledger.commands.common import remember_command_line

        remember_command_line(a for a in argv if a != "--debug")
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except cx.ClickException as exc:
            from attn_ledger.commands.common import say

            say(f"error: {usage_line(exc, argv)}")
            rv = getattr(exc, "exit_code", 2) if not isinstance(exc, cx.UsageError) else 2
        except Abort:
            rv = 130
        except Terminated:
            rv = EXIT_TERMINATED
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv

    def format_help(self, ctx: Any, formatter: Any) -> None:
        with _help_view(self.get_params(ctx), ctx):
            super().format_help(ctx, formatter)


app = typer.Typer(
    name="attn-ledger",
    cls=_OneLineErrors,
    help=(
        "Diagnose attention code that runs but is wrong. Runs attention as named stages "
        "(split, scores, mask, softmax, mix, merge), checks shape, axis semantics, numerical "
        "invariants and behaviour at each, and names the first stage that diverges.\n\n" + EXIT_HELP
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


def _debug(value: bool) -> None:
    if value:
        os.environ["ATTN_LEDGER_DEBUG"] = "1"


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
    debug: Annotated[
        bool, typer.Option("--debug", callback=_debug, is_eager=True,
                           help="Show the traceback of an internal error (exit 3); also ATTN_LEDGER_DEBUG=1.")
    ] = False,
) -> None:
    pass


from attn_ledger.commands import run as _run  # noqa: E402

app.command("run", cls=_Command)(_run.run)

from attn_ledger.commands import intervene as _intervene  # noqa: E402

app.command("intervene", cls=_Command)(_intervene.intervene)

from attn_ledger.commands import polarity as _polarity  # noqa: E402
from attn_ledger.commands import sweep_scale as _sweep_scale  # noqa: E402

app.command("sweep-scale", cls=_Command)(_sweep_scale.sweep_scale)
app.command("polarity", cls=_Command)(_polarity.polarity)

from attn_ledger.commands import check as _check  # noqa: E402
from attn_ledger.commands import faults as _faults  # noqa: E402

app.command("check", cls=_Command)(_check.check)
app.command("faults", cls=_Command)(_faults.faults)

from attn_ledger.commands import scan as _scan  # noqa: E402

app.command("scan", cls=_Command)(_scan.scan)

from attn_ledger.commands import compare as _compare  # noqa: E402

app.command("compare", cls=_Command)(_compare.compare)


def main() -> None:
    """The ``attn-ledger`` process: SIGTERM unwinds like Ctrl-C, and nothing it started outlives it."""
    import signal

    from attn_ledger.runner import reaper

    signal.signal(signal.SIGTERM, _terminate)
    try:
        app()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup runs whole
        reaper.end_all()
