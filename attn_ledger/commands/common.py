"""What every command shares: output formats, writing reports, the exit-status contract, progress.

Exit statuses: 0 everything asked holds; 1 a finding; 2 bad input, usage or setup (one line
on stderr); 3 an internal error of the tool itself (one line saying so; ``--debug`` or
``ATTN_LEDGER_DEBUG=1`` shows the traceback). No output path changes unless the report was built
and every output written whole; none may be an input (:func:`execute`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import typer

from attn_ledger.errors import AttnLedgerError, InputError, first_line


class Format(str, Enum):
    """How a report is written."""

    table = "table"
    json = "json"
    markdown = "markdown"
    junit = "junit"
    github = "github"


EXIT_OK, EXIT_FINDING, EXIT_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
DEBUG_ENV = "ATTN_LEDGER_DEBUG"


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def say(message: str) -> None:
    """One line on stderr, never re-wrapped or styled from its content."""
    stderr_console().print(message, markup=False, highlight=False, soft_wrap=True)


def fail(message: str) -> typer.Exit:
    """Print one line on stderr and return the exit-2 exception to raise."""
    say(f"error: {message}")
    return typer.Exit(EXIT_INPUT)


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def render_text(report: Any, fmt: Format, width: int | None = None, detail: bool = False) -> str:
    """Render a report to a string in the given format (tables at ``width`` columns, default 100;
    compact unless ``detail``)."""
    from attn_ledger.render import render

    return render(report, fmt.value, width or 100, detail)


def check_output_path(path: Path | None, field: str = "output") -> None:
    """Refuse, before any work, an output path that cannot be written as a regular file."""
    if path is None:
        return
    text = str(path)
    if text.strip() == "":
        raise InputError(f"{field}: got '', expected a file path")
    p = Path(text)
    try:
        if p.is_dir():
            raise InputError(f"{field}: got {text!r}, a directory; expected a file path")
        if p.exists() and not p.is_file():
            raise InputError(f"{field}: got {text!r}, which is not a regular file; expected a file path")
        directory = p.parent if str(p.parent) else Path(".")
        if not directory.is_dir():
            raise InputError(f"{field}: got {text!r}, expected a file in an existing directory")
    except OSError as exc:  # a directory on the way that cannot be searched
        raise InputError(f"{field}: got {text!r}, cannot reach it ({exc.strerror or exc})") from None
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=f".{p.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"{field}: got {text!r}, cannot write there ({exc.strerror or exc})") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise InputError(f"{field}: got {text!r}, the file is not writable")


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file: equal once resolved (links followed), or one inode where both exist."""
    try:
        if Path(a).resolve() == Path(b).resolve():
            return True
    except (OSError, RuntimeError):  # a link loop: compare what can be compared below
        pass
    try:
        sa, sb = os.stat(a), os.stat(b)
    except (OSError, ValueError):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def spec_path(spec: str | None) -> str | None:
    """The file of a ``path/to/file.py:NAME`` spec (None for ``package.module:NAME`` or no spec)."""
    if not spec or ":" not in spec:
        return None
    source = spec.rsplit(":", 1)[0]
    return source if source.endswith(".py") or "/" in source or "\\" in source else None


def check_clashes(outputs: Mapping[str, Any], inputs: Mapping[str, Any] = {}) -> None:
    """Refuse an output that is one of the inputs, or another output: it would be destroyed or lost.

    Args:
        outputs: field -> the path written there (None: not given), in the order the fields are named.
        inputs: field -> a path the command reads (None: not given).

    Raises:
        InputError: one line naming both fields and the path.
    """
    given = [(f, p) for f, p in outputs.items() if p is not None]
    for i, (field, path) in enumerate(given):
        for other, used in given[:i]:
            if same_file(path, used):
                raise InputError(f"{field}: got {str(path)!r}, the same file as {_option(other)}; expected another file")
        for other, used in inputs.items():
            if used is not None and same_file(path, used):
                raise InputError(f"{field}: got {str(path)!r}, the same file as the input {other} ({str(used)!r}); "
                                 "expected a file that is not an input")


def _option(field: str) -> str:
    return field if field.startswith("-") or "." in field else f"--{field}"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Staged:
    """Output files written in full beside their targets under temporary names, then renamed together.

    :meth:`add` writes one; a failure names its field and leaves every target as it was.
    :meth:`commit` renames them all; :meth:`discard` removes whatever was not renamed.
    """

    def __init__(self) -> None:
        self.files: list[tuple[str, Path, str]] = []  # (field, target, temporary file)

    def add(self, field: str, path: Path, content: str | bytes) -> None:
        path = Path(path)
        directory = path.parent if str(path.parent) else Path(".")
        data = content.encode("utf-8") if isinstance(content, str) else content
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as exc:
            raise InputError(f"{field}: got {str(path)!r}, cannot write there ({exc.strerror or exc})") from None
        self.files.append((field, path, tmp))
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.chmod(tmp, 0o666 & ~_umask())  # a new file's usual mode (mkstemp makes it 0600)
        except OSError as exc:
            raise InputError(f"{field}: got {str(path)!r}, cannot write there ({exc.strerror or exc})") from None

    def commit(self) -> None:
        for field, path, tmp in self.files:  # each still there, so that the renames below all succeed or none runs
            if not os.path.isfile(tmp):
                raise InputError(f"{field}: got {str(path)!r}, cannot write there (its directory changed meanwhile)")
        while self.files:
            field, path, tmp = self.files[0]
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise InputError(f"{field}: got {str(path)!r}, cannot write there ({exc.strerror or exc})") from None
            self.files.pop(0)

    def discard(self) -> None:
        for _, _, tmp in self.files:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self.files = []


def write_atomic(path: Path, text: str, field: str = "output") -> None:
    """Write text so that a reader never sees a half-written file."""
    staged = Staged()
    try:
        staged.add(field, path, text)
        staged.commit()
    finally:
        staged.discard()


def report_text(report: Any, fmt: Format, show: Sequence[str] = (), detail: bool = False) -> str:
    """A report as written to a file: tables at 100 columns, heatmaps in plain ASCII after the table."""
    from attn_ledger.render.heatmap import render_heatmap

    return render_text(report, fmt, detail=detail) + "".join("\n" + render_heatmap(report, kind, 100) for kind in show)


def emit(report: Any, fmt: Format, output: Path | None, show: Sequence[str] = (), detail: bool = False) -> None:
    """Write a report to stdout (a table in colour where the terminal has it) or to a file.

    ``show``: heatmaps (``weights``, ``mask``) drawn after the table; block characters and
    colour on a terminal, plain ASCII in a file or a pipe.
    """
    from attn_ledger.render.heatmap import heatmap_lines, render_heatmap

    if output is not None:
        write_atomic(output, report_text(report, fmt, show, detail))
        return
    from rich.console import Console

    console = Console(soft_wrap=True)
    if fmt is Format.table and console.is_terminal:
        from attn_ledger.render.table import layout, rich_lines

        lines = layout(report, console.width, detail)
        charset = "unicode" if (console.encoding or "").lower().replace("-", "") == "utf8" else "ascii"
        for kind in show:
            lines += [[]] + heatmap_lines(report, kind, console.width, charset)
        for line in rich_lines(lines):
            console.print(line)
        return
    text = render_text(report, fmt, width=console.width if fmt is Format.table else None, detail=detail)
    text += "".join("\n" + render_heatmap(report, kind, console.width) for kind in show)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`| head`): say nothing more, keep the status
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


_COMMAND_LINE: list[str] | None = None


def remember_command_line(argv: Sequence[str]) -> None:
    """Keep the arguments the CLI was called with, for reports that show their command line."""
    global _COMMAND_LINE
    _COMMAND_LINE = list(argv)


def command_line() -> str:
    """``attn-ledger`` and the arguments it was called with, as a shell would take them back."""
    from attn_ledger.render.html import command_line_text

    return command_line_text(sys.argv[1:] if _COMMAND_LINE is None else _COMMAND_LINE)


def check_show(show: Sequence[str], fmt: Format) -> None:
    """Heatmaps print after the table; other formats keep stdout to one document."""
    if show and fmt is not Format.table:
        raise InputError(f"show: got --show with --format {fmt.value}, expected --format table "
                         "(the heatmaps print after the table; --html writes them into a page)")


def internal_error(command: str, exc: BaseException, fmt: Format) -> typer.Exit:
    """Exit status 3: say it is a bug in the tool, in one line; JSON output gets an error envelope."""
    first = first_line(exc, "")
    message = f"{type(exc).__name__}" + (f": {first}" if first else "")
    if debug_enabled():
        import traceback

        traceback.print_exception(exc)
    if fmt is Format.json:
        from attn_ledger.render.jsondoc import dumps, error_json

        sys.stdout.write(dumps(error_json(command, message)))
        sys.stdout.flush()
    say(f"error: internal error in attn-ledger (a bug in the tool, not in your code): {message}. "
        f"Run again with --debug or {DEBUG_ENV}=1 for the traceback.")
    return typer.Exit(EXIT_INTERNAL)


def execute(build: Callable[[], Any], fmt: Format, output: Path | None, *, command: str = "",
            timings: bool = False, show: Sequence[str] = (), html: Path | None = None, detail: bool = False,
            inputs: Mapping[str, Any] = {}, files: Mapping[str, tuple[Path | None, Callable[[Any], bytes]]] = {}) -> None:
    """Run a command body: build the report, render it, write every output or none, exit with its status.

    Bad input (any :class:`AttnLedgerError`) becomes one line on stderr and exit 2; any other
    exception is an internal error, exit 3. ``show``: heatmaps after the table; ``html``: also
    write the report as one self-contained page there; ``files``: field -> (path, how to make its
    bytes from the report), further outputs such as ``--plot``. ``inputs``: field -> a path the
    command reads; an output that is an input, or another output, is refused before any work.
    ``detail``: the full table (``--detail``). ``--format github`` also appends a job summary (:func:`step_summary_path`).

    Every output is written to a temporary file beside it; only when all are written, and every
    process the command started has ended (:mod:`attn_ledger.runner.reaper`), are they renamed into
    place. Any failure leaves every output path as it was. The process keeps freed memory for
    reuse (see :mod:`attn_ledger.alloc`).
    """
    from attn_ledger.runner import reaper
    from attn_ledger.alloc import retain_freed_memory

    retain_freed_memory()  # this process is ours: keep freed grid blocks for the next block
    before = reaper.snapshot()  # what runs already is not this command's to end
    reaper.become_subreaper()  # a process its workers orphan comes back here, to be ended
    staged = Staged()
    try:
        outputs = {"output": output, "html": html, **{field: path for field, (path, _) in files.items()}}
        for field, path in outputs.items():
            check_output_path(path, field)
        check_clashes(outputs, inputs)
        check_show(show, fmt)
        summary = step_summary_path(fmt)
        start = time.perf_counter()
        report = build()
        if timings:
            report = _with_timing(report, time.perf_counter() - start)
        if output is not None:
            staged.add("output", output, report_text(report, fmt, show, detail))
        if html is not None:
            from attn_ledger.render.html import render_html

            staged.add("html", html, render_html(report, command_line()))
        for field, (path, make) in files.items():
            if path is not None:
                staged.add(field, path, make(report))
        reaper.end_descendants(before, keep=reaper.helper_pids())  # none of them may write after this
        staged.commit()
        if summary is not None:
            append_step_summary(summary, report)
        if output is None:
            emit(report, fmt, None, show, detail)
    except AttnLedgerError as exc:
        raise fail(str(exc)) from None
    except typer.Exit:
        raise
    except Exception as exc:  # anything else is the tool's own bug: exit 3, never a finding
        raise internal_error(command, exc, fmt) from None
    finally:
        staged.discard()
        reaper.end_descendants(before, keep=reaper.helper_pids())
    raise typer.Exit(report.exit_code)


STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"


def step_summary_path(fmt: Format) -> Path | None:
    """The job summary file GitHub Actions names in ``GITHUB_STEP_SUMMARY``, for ``--format github``
    only; refused before any work (exit 2) when it cannot be appended to."""
    text = os.environ.get(STEP_SUMMARY_ENV, "")
    if fmt is not Format.github or text == "":  # unset or empty: not in a job that keeps a summary
        return None
    check_output_path(Path(text), STEP_SUMMARY_ENV)
    return Path(text)


def append_step_summary(path: Path, report: Any) -> None:
    """Append (never overwrite) the report's Markdown step summary to ``path``."""
    from attn_ledger.render.github import step_summary

    try:
        with open(path, "a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:  # another step's summary is there: a blank line between, so ours starts a block
                fh.write(b"\n")
            fh.write(step_summary(report).encode("utf-8"))
    except OSError as exc:
        raise InputError(f"{STEP_SUMMARY_ENV}: got {str(path)!r}, cannot append there ({exc.strerror or exc})") from None


def _with_timing(report: Any, seconds: float) -> Any:
    from dataclasses import replace

    from attn_ledger.report import Note

    return replace(report, details={**report.details, "elapsed_s": round(seconds, 3)},
                   notes=(*report.notes, Note("elapsed", {"seconds": seconds})))


class Progress:
    """A progress bar on stderr that appears only once work has taken over a second, and only on a terminal.

    Library code takes a plain ``callback(done, total)``; pass ``Progress(label)``
    (it is callable) from the CLI, or nothing from library users and tests.
    """

    def __init__(self, label: str, delay_s: float = 1.0) -> None:
        self.label = label
        self.delay_s = delay_s
        self.start = time.monotonic()
        self._bar: Any = None
        self._task: Any = None
        self._terminal: bool | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            if time.monotonic() - self.start < self.delay_s or done >= total:
                return
            if self._terminal is None:
                self._terminal = stderr_console().is_terminal
            if not self._terminal:  # a log or a pipe: a bar would leave only blank lines there
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

            self._bar = RichProgress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=stderr_console(), transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=total)
        self._bar.update(self._task, completed=done, total=total)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
