"""What every command shares: output formats, rendering to a file, errors to exit 2, progress."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import typer

from attn_ledger.errors import AttnLedgerError


class Format(str, Enum):
    """How a report is written."""

    table = "table"
    json = "json"
    markdown = "markdown"


def stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def fail(message: str) -> typer.Exit:
    """Print one line on stderr and return the exit-2 exception to raise."""
    stderr_console().print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(2)


def render_text(report: Any, fmt: Format, width: int | None = None, color: bool = True) -> str:
    """Render a report to a string in the given format."""
    if fmt is Format.json:
        return json.dumps(report.to_json(), indent=2, allow_nan=False) + "\n"
    if fmt is Format.markdown:
        return report.to_markdown()
    import io

    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width or 120, color_system=None, force_terminal=False)
    console.print(report.to_rich())
    return buf.getvalue()


def write_atomic(path: Path, text: str) -> None:
    """Write text so that a reader never sees a half-written file."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise AttnLedgerError(f"output: directory does not exist: {str(directory)!r}")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def emit(report: Any, fmt: Format, output: Path | None) -> None:
    """Write a report to stdout (rich, with colour where the terminal has it) or to a file."""
    if output is not None:
        write_atomic(output, render_text(report, fmt))
        return
    if fmt is Format.table:
        from rich.console import Console

        Console().print(report.to_rich())
    else:
        sys.stdout.write(render_text(report, fmt))
        sys.stdout.flush()


def execute(build: Callable[[], Any], fmt: Format, output: Path | None) -> None:
    """Run a command body: build the report, render it, exit with its status.

    Bad input (any :class:`AttnLedgerError`) becomes one line on stderr and exit 2,
    with nothing written to ``output``. The process keeps freed memory for reuse
    (see :mod:`attn_ledger.alloc`).
    """
    from attn_ledger.alloc import retain_freed_memory

    retain_freed_memory()  # this process is ours: keep freed grid blocks for the next block
    try:
        report = build()
        emit(report, fmt, output)
    except AttnLedgerError as exc:
        raise fail(str(exc)) from None
    raise typer.Exit(report.exit_code)


class Progress:
    """A progress bar on stderr that appears only once work has taken over a second.

    Library code takes a plain ``callback(done, total)``; pass ``Progress(label)``
    (it is callable) from the CLI, or nothing from library users and tests.
    """

    def __init__(self, label: str, delay_s: float = 1.0) -> None:
        self.label = label
        self.delay_s = delay_s
        self.start = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            if time.monotonic() - self.start < self.delay_s or done >= total:
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
