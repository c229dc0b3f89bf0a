#!/usr/bin/env python
"""Regenerate, or check, every marked example and generated table in README.md and docs/*.md.

Pages are never edited by hand where the tool speaks: a marked block is rewritten from
what the tool prints now.

Marked blocks (the marker is an HTML comment on the line before the block; GitHub hides it):

    <!-- example [exit=N] [width=N] [exempt=timing|install|gpu] -->
    ```console
    $ attn-ledger run --fault split-reshape      <- written by hand: the command
    ...                                          <- generated: what it prints
    $ echo $?                                    <- optional: the exit status, generated
    ```

    <!-- example [raises] -->
    ```pycon
    >>> from attn_ledger.inputs.config import load_config   <- written by hand
    >>> report.verdict
    'fail'                                            <- generated
    ```

    <!-- generated: NAME [ARG] -->
    ...                                          <- generated from the code (see GENERATORS)
    <!-- end generated -->

A console block runs each ``$`` line: ``NAME=value`` (a shell variable, expanded as
``$NAME`` in the lines below), ``attn-ledger ...`` (with optional ``NAME=value``
environment prefixes, ``2>/dev/null`` and pipes into ``head -n N``, ``tail -n N`` or
``grep [-E] [-i] [-v] [-c] PATTERN``), ``echo $?`` and ``cat FILE``.
``exit`` is the status every ``attn-ledger`` line must end with (default 0; a comma-separated
list gives one per line); ``width`` the terminal width (COLUMNS, default 100). Each block
runs in a fresh temporary directory that links the repository's top-level entries, so
``--output`` writes nothing into the tree. Exempt blocks (timing figures, install lines,
GPU-only examples) are neither run nor compared; nothing else may be exempt. A pycon
statement that raises is an error unless the marker says ``raises``.

Examples run in worker processes with one thread and ``MKL_ENABLE_INSTRUCTIONS=AVX2``, at the CPU
capability torch picks on this machine: ``ATEN_CPU_CAPABILITY`` is not pinned, so an example that holds
only at one capability fails where it does not, and ``ATEN_CPU_CAPABILITY=default python scripts/docs.py
--check`` checks the pages at another. Comparison masks values below
1e-5 (rounding-level differences vary with the CPU's instruction set), normalises paths and
whitespace, and keeps every other number exact. A block whose output compares equal is
left as it is, so regenerating twice, or on another machine, leaves the tree unchanged.

Usage:
    python scripts/docs.py                      regenerate every page
    python scripts/docs.py docs/run.md          regenerate one page
    python scripts/docs.py docs/run.md:42       regenerate the block marked on line 42
    python scripts/docs.py --check              compare only; exit 1 naming each block that differs
    python scripts/docs.py --check --json FILE  also write per-block results (the test suite reads them)

Exit status: 0 every page matches (or was rewritten), 1 a block differs (--check) or an
example failed to run (wrong exit status, unsupported command), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE_GLOBS = ("README.md", "docs/*.md")
EXEMPT_REASONS = ("timing", "install", "gpu")
DEFAULT_WIDTH = 100
TINY = 1e-5
# The environment every example runs in: one thread, no colour. ATEN_CPU_CAPABILITY is left as the
# caller has it (unset: the machine's best), so the pages are checked where users run them.
FIXED_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "PYTHONHASHSEED": "0",
    "NO_COLOR": "1",
    "TERM": "dumb",
}

MARKER = re.compile(r"^<!--\s*(example\b|generated:)\s*(.*?)\s*-->\s*$")
END_GENERATED = re.compile(r"^<!--\s*end generated\s*-->\s*$")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w-]*)\s*$")


# --- pages and blocks --------------------------------------------------------------------

@dataclass
class Block:
    """One marked block of a page: where it is, what it runs, and its current body."""

    page: str  # relative to the repository root
    line: int  # 1-based line of the marker
    kind: str  # "console", "pycon" or "generated"
    options: dict[str, str]
    body_start: int  # 0-based index of the first body line
    body_end: int  # 0-based index one past the last body line
    body: list[str]
    inputs: list[str] = field(default_factory=list)  # commands, statements, or the generator call

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def exempt(self) -> str | None:
        return self.options.get("exempt")

    @property
    def label(self) -> str:
        first = self.inputs[0].splitlines()[0] if self.inputs else ""
        return f"{self.id} ({self.kind}: {first})"


class PageError(Exception):
    """A page's markers are malformed."""


def parse_options(text: str, where: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for token in shlex.split(text):
        key, _, value = token.partition("=")
        if key not in ("exit", "width", "exempt", "raises"):
            raise PageError(f"{where}: unknown marker option {key!r}, expected exit=, width=, exempt= or raises")
        options[key] = value
    if "exempt" in options and options["exempt"] not in EXEMPT_REASONS:
        raise PageError(f"{where}: exempt={options['exempt']!r}, expected one of {', '.join(EXEMPT_REASONS)}")
    return options


def parse_page(page: str, text: str) -> list[Block]:
    """The marked blocks of one page, in order."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        where = f"{page}:{i + 1}"
        if m.group(1) == "generated:":
            end = next((j for j in range(i + 1, len(lines)) if END_GENERATED.match(lines[j])), None)
            if end is None:
                raise PageError(f"{where}: '<!-- generated: ... -->' without '<!-- end generated -->'")
            blocks.append(Block(page, i + 1, "generated", {}, i + 1, end, lines[i + 1:end], [m.group(2)]))
            i = end + 1
            continue
        options = parse_options(m.group(2), where)
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not fence or (fence.group(2) not in ("console", "pycon") and "exempt" not in options):
            raise PageError(f"{where}: an example marker must be followed by a ```console or ```pycon fence "
                            "(any fence, if the example is exempt)")
        close = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == fence.group(1)), None)
        if close is None:
            raise PageError(f"{where}: the fence opened on line {i + 2} is never closed")
        kind = fence.group(2) or "text"
        body = lines[i + 2:close]
        block = Block(page, i + 1, kind, options, i + 2, close, body)
        block.inputs = pycon_inputs(body) if kind == "pycon" else console_inputs(body)
        if not block.inputs and "exempt" in options:
            block.inputs = [body[0] if body else ""]
        if not block.inputs:
            raise PageError(f"{where}: the example has no {'$ command' if kind == 'console' else '>>> statement'}")
        blocks.append(block)
        i = close + 1
    return blocks


def console_inputs(body: list[str]) -> list[str]:
    """The commands of a console block: each ``$ `` line, joined with its ``\\`` continuations."""
    commands: list[str] = []
    i = 0
    while i < len(body):
        if body[i].startswith("$ "):
            parts = [body[i][2:]]
            while parts[-1].endswith("\\") and i + 1 < len(body):
                i += 1
                parts.append(body[i])
            commands.append("\n".join(parts))
        i += 1
    return commands


def pycon_inputs(body: list[str]) -> list[str]:
    """The statements of a pycon block: each ``>>> `` line with its ``... `` continuations."""
    statements: list[str] = []
    for line in body:
        if line.startswith(">>> ") or line == ">>>":
            statements.append(line[4:])
        elif (line.startswith("... ") or line == "...") and statements:
            statements[-1] += "\n" + line[4:]
    return statements


def render_body(block: Block, outputs: list[str]) -> list[str]:
    """The block's body rebuilt from its inputs and their outputs."""
    if block.kind == "generated":
        return outputs[0].rstrip("\n").split("\n")
    lines: list[str] = []
    for src, out in zip(block.inputs, outputs):
        if block.kind == "console":
            src_lines = src.split("\n")
            lines.append("$ " + src_lines[0])
            lines.extend(src_lines[1:])
        else:
            src_lines = src.split("\n")
            lines.append(">>> " + src_lines[0])
            lines.extend("... " + s if s else "..." for s in src_lines[1:])
        text = out.rstrip("\n")
        if text:
            lines.extend(line.rstrip() for line in text.split("\n"))
    return lines


def pages(selected: list[str] | None = None) -> list[str]:
    if selected:
        return selected
    found: list[str] = []
    for pattern in PAGE_GLOBS:
        found += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern))
    return found


# --- comparing ---------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?!\w)(?!\.\d)")
RULE = re.compile(r"^[-─━═┄┈|│┃+┼╇┡┩┏┓┗┛┳┻╋└┘┌┐├┤┬┴]{3,}$")


def _mask_number(m: re.Match[str]) -> str:
    try:
        value = float(m.group(0))
    except ValueError:
        return m.group(0)
    return "<tiny>" if abs(value) < TINY else m.group(0)


def normalise_line(line: str) -> str:
    """One line as compared: values below 1e-5 masked, absolute paths and runs of spaces collapsed."""
    line = line.replace(str(ROOT), ".")
    line = re.sub(r"/tmp/attn-ledger-docs-[\w]+", ".", line)
    line = NUMBER.sub(_mask_number, line)
    return " ".join("<rule>" if RULE.match(tok) else tok for tok in line.split())


def tokens(lines: list[str]) -> list[str]:
    """The whole body as a token stream: where a table wraps does not matter, every token does."""
    return " ".join(normalise_line(line) for line in lines).split()


def same(old: list[str], new: list[str]) -> bool:
    return tokens(old) == tokens(new)


def diff_text(old: list[str], new: list[str], page: str, limit: int = 60) -> str:
    a = [normalise_line(x) for x in old]
    b = [normalise_line(x) for x in new]
    lines = list(difflib.unified_diff(a, b, f"{page} (page)", "tool output now", lineterm="", n=2))
    if len(lines) > limit:
        lines = lines[:limit] + [f"... ({len(lines) - limit} more diff lines)"]
    return "\n".join(lines)


# --- running (in a worker process) --------------------------------------------------------

class ExampleError(Exception):
    """An example could not be run as written."""


def _workdir() -> str:
    import tempfile

    tmp = tempfile.mkdtemp(prefix="attn-ledger-docs-")
    for entry in ROOT.iterdir():
        # not the package: a fork server started here would import it from this directory (its sys.path
        # starts with the working directory), and fail on its next import once the directory is removed
        if not entry.name.startswith(".") and entry.name != "attn_ledger":
            os.symlink(entry, os.path.join(tmp, entry.name))
    return tmp


def _split_pipeline(command: str) -> tuple[list[str], list[list[str]]]:
    lexer = shlex.shlex(command.replace("\\\n", " "), posix=True, punctuation_chars="|")
    lexer.whitespace_split = True
    parts: list[list[str]] = [[]]
    for tok in lexer:
        if tok == "|":
            parts.append([])
        else:
            parts[-1].append(tok)
    return parts[0], parts[1:]


def _filter(text: str, stage: list[str]) -> str:
    """One pipe stage: ``head -n N``, ``tail -n N`` or ``grep [-E] [-i] [-v] [-c] PATTERN`` (a Python regex)."""
    lines = text.splitlines(keepends=True)
    m = re.fullmatch(r"(head|tail) -n (\d+)", " ".join(stage))
    if m:
        n = int(m.group(2))
        return "".join(lines[:n] if m.group(1) == "head" else lines[-n:])
    if stage and stage[0] == "grep" and len(stage) >= 2:
        flags = set(stage[1:-1])
        if flags <= {"-v", "-c", "-i", "-E"}:
            pattern = re.compile(stage[-1], re.IGNORECASE if "-i" in flags else 0)
            kept = [line for line in lines if bool(pattern.search(line)) != ("-v" in flags)]
            return f"{len(kept)}\n" if "-c" in flags else "".join(kept)
    raise ExampleError(f"unsupported pipe '| {' '.join(stage)}': only head -n N, tail -n N and grep [-E] [-i] [-v] [-c] PATTERN")


class Shell:
    """Runs one console block's commands in-process, as a terminal of ``width`` columns would show them."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.status = 0
        self.variables: dict[str, str] = {}

    def run(self, command: str) -> tuple[str, int | None]:
        """Run one command line: its stdout through any pipes, then its stderr (as a terminal shows them)."""
        command = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: self.variables.get(m.group(1), ""), command)
        argv, pipes = _split_pipeline(command)
        env: dict[str, str] = {}
        while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        if not argv and not pipes:  # NAME=value alone: a shell variable for the lines below
            self.variables.update(env)
            return "", None
        quiet_stderr = "2>/dev/null" in argv
        merge_stderr = "2>&1" in argv
        argv = [a for a in argv if a not in ("2>/dev/null", "2>&1")]
        if not argv:
            raise ExampleError("empty command")
        status: int | None = None
        err = ""
        if argv[0] == "attn-ledger":
            out, err, status = self._tool(argv[1:], env)
        elif argv == ["echo", "$?"]:
            out = f"{self.status}\n"
        elif argv[0] == "cat" and len(argv) >= 2:
            out = "".join(Path(p).read_text() for p in argv[1:])
        else:
            raise ExampleError(f"unsupported command {argv[0]!r}: examples run attn-ledger, echo $? and cat")
        if merge_stderr:
            out, err = out + err, ""
        for stage in pipes:
            out = _filter(out, stage)
        return out + ("" if quiet_stderr else err), status

    def _tool(self, args: list[str], env: dict[str, str]) -> tuple[str, str, int]:
        from typer.testing import CliRunner

        from attn_ledger.cli import app

        saved = dict(os.environ)
        try:
            result = CliRunner().invoke(app, args, env={"COLUMNS": str(self.width), **env}, catch_exceptions=True)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise ExampleError(f"attn-ledger raised {type(result.exception).__name__}: {result.exception}")
        self.status = result.exit_code
        return result.stdout, result.stderr, result.exit_code


def run_console(commands: list[str], width: int) -> tuple[list[str], list[int]]:
    shell = Shell(width)
    outputs, statuses = [], []
    for command in commands:
        text, status = shell.run(command)
        outputs.append(text)
        if status is not None:
            statuses.append(status)
    return outputs, statuses


def run_pycon(statements: list[str]) -> tuple[list[str], list[int]]:
    """Each statement as the interactive interpreter runs it: expression values are printed.

    Returns the outputs and the indices of the statements that raised.
    """
    import contextlib
    import io
    import traceback

    namespace: dict[str, Any] = {"__name__": "__main__"}
    outputs, raised = [], []
    for i, src in enumerate(statements):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                exec(compile(src + "\n", "<example>", "single"), namespace)
            except Exception as exc:  # shown as the interpreter shows it
                raised.append(i)
                buf.write("Traceback (most recent call last):\n  ...\n")
                buf.write("".join(traceback.format_exception_only(type(exc), exc)))
        outputs.append(buf.getvalue())
    return outputs, raised


def run_request(request: dict[str, Any]) -> dict[str, Any]:
    """Run one block (in a worker): its outputs, the tool's exit statuses, or the error."""
    import torch

    cwd = os.getcwd()
    workdir = _workdir()
    os.chdir(workdir)
    try:
        torch.manual_seed(0)
        kind = request["kind"]
        if kind == "console":
            outputs, statuses = run_console(request["inputs"], request["width"])
            return {"outputs": [_paths(o, workdir) for o in outputs], "statuses": statuses}
        if kind == "pycon":
            outputs, raised = run_pycon(request["inputs"])
            return {"outputs": [_paths(o, workdir) for o in outputs], "statuses": [], "raised": raised}
        name, _, arg = request["inputs"][0].partition(" ")
        if name not in GENERATORS:
            raise ExampleError(f"unknown generator {name!r}, expected one of {', '.join(sorted(GENERATORS))}")
        return {"outputs": [GENERATORS[name](arg.strip())], "statuses": []}
    except ExampleError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # a broken example must name itself, not end the run
        import traceback

        return {"error": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-3000:]}
    finally:
        os.chdir(cwd)
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def _paths(text: str, workdir: str) -> str:
    return text.replace(os.path.realpath(workdir) + "/", "").replace(workdir + "/", "").replace(str(ROOT) + "/", "")


def worker() -> None:
    """Serve run requests: one JSON line in, one JSON line out, on a private copy of stdout."""
    proto_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else written to stdout (user code, libraries) goes to stderr
    sys.stdout = sys.stderr
    import torch

    torch.set_num_threads(1)
    for line in sys.stdin:
        result = run_request(json.loads(line))
        proto_out.write(json.dumps(result) + "\n")
        proto_out.flush()


# --- generated tables --------------------------------------------------------------------

def gen_stage_checks(arg: str) -> str:
    """The ledger's stages and their checks, from attn_ledger.engine.stages (the list the ledger is tested against)."""
    from attn_ledger.engine.stages import markdown_table

    return markdown_table(arg or "pipeline")


def gen_options(command: str) -> str:
    """A command's arguments and options with their help, from the command line definition itself."""
    import typer.main

    from attn_ledger.cli import app

    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    ctx = cmd.make_context(command, [], resilient_parsing=True)
    rows = ["| argument or option | meaning |", "| --- | --- |"]
    for param in cmd.params:
        record = param.get_help_record(ctx)
        if record is None or param.name == "help":
            continue
        usage, text = record
        text = " ".join(text.split()).replace("|", "\\|")
        rows.append(f"| `{usage.replace('|', chr(92) + '|')}` | {text} |")
    return "\n".join(rows)


def gen_faults(arg: str) -> str:
    """The fault catalogue of ``attn-ledger faults``: each fault's kind and what it does."""
    from attn_ledger.probes.catalogue import CATALOGUE

    rows = ["| fault | kind | what it does | in `run --fault` |", "| --- | --- | --- | --- |"]
    for fault in CATALOGUE:
        rows.append(f"| `{fault.name}` | {fault.kind} | {fault.summary} | {'yes' if fault.pipeline_fault else 'no'} |")
    return "\n".join(rows)


def gen_pipeline_faults(arg: str) -> str:
    """The built-in pipeline's faults, what each does, and where the default ledger first sees it."""
    from attn_ledger.inputs.config import FAULT_NEEDS, load_config
    from attn_ledger.ledger import run_ledger
    from attn_ledger.maths.pipeline import FAULT_SUMMARIES
    from attn_ledger.report import LEVEL_NAMES

    rows = ["| `--fault` | what it does | first finding on the default config |", "| --- | --- | --- |"]
    for name, summary in FAULT_SUMMARIES.items():
        needs = FAULT_NEEDS.get(name, {})
        found = run_ledger(load_config(overrides={"fault": name, **needs})).first_finding
        where = "none" if found is None else (
            f"`{found.row}`, L{found.check.level} {LEVEL_NAMES[found.check.level]}: `{found.check.name}`")
        said = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in needs.items())
        rows.append(f"| `{name}` | {summary} | {where}{f' (with `{said}`)' if said else ''} |")
    return "\n".join(rows)


GENERATORS = {
    "stage-checks": gen_stage_checks,
    "options": gen_options,
    "faults": gen_faults,
    "pipeline-faults": gen_pipeline_faults,
}


# --- the pool and the pages ----------------------------------------------------------------

def worker_env() -> dict[str, str]:
    env = {**os.environ, **FIXED_ENV}
    env.pop("COLUMNS", None)
    env.pop("ATTN_LEDGER_DEBUG", None)
    return env


def request_of(block: Block) -> dict[str, Any]:
    return {"kind": block.kind, "inputs": block.inputs, "width": int(block.options.get("width", DEFAULT_WIDTH))}


def run_blocks(blocks: list[Block], jobs: int) -> dict[str, dict[str, Any]]:
    """Run blocks in ``jobs`` worker processes; results by block id."""
    todo: queue.Queue[Block] = queue.Queue()
    for block in sorted(blocks, key=_cost, reverse=True):
        todo.put(block)
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def serve() -> None:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=worker_env())
        assert proc.stdin is not None and proc.stdout is not None
        try:
            while True:
                try:
                    block = todo.get_nowait()
                except queue.Empty:
                    break
                proc.stdin.write(json.dumps(request_of(block)) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                result = json.loads(line) if line else {"error": "the worker process ended unexpectedly"}
                with lock:
                    results[block.id] = result
        finally:
            proc.stdin.close()
            proc.wait()

    threads = [threading.Thread(target=serve) for _ in range(max(1, min(jobs, len(blocks))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _cost(block: Block) -> int:
    """A rough order for the pool: the long examples first, so two workers finish together."""
    text = " ".join(block.inputs)
    return 10 if re.search(r"attn-ledger faults\b", text) else 1 + len(block.inputs)


def expected_statuses(block: Block, n: int) -> list[int]:
    given = [int(s) for s in block.options.get("exit", "0").split(",")]
    return given * n if len(given) == 1 else given


def judge(block: Block, result: dict[str, Any]) -> dict[str, Any]:
    """Compare one block with its result: same, differs (with the new body) or error."""
    out: dict[str, Any] = {"id": block.id, "page": block.page, "line": block.line, "label": block.label,
                           "regenerate": f"python scripts/docs.py {block.page}"}
    if "error" in result:
        return {**out, "status": "error", "error": result["error"]}
    statuses = result["statuses"]
    want = expected_statuses(block, len(statuses))
    if block.kind == "console" and statuses != want:
        return {**out, "status": "error",
                "error": f"attn-ledger exit status {statuses}, the marker expects exit={block.options.get('exit', '0')}"}
    if result.get("raised") and "raises" not in block.options:
        first = block.inputs[result["raised"][0]].splitlines()[0]
        return {**out, "status": "error",
                "error": f"the statement {first!r} raised (mark the example 'raises' if it is meant to)"}
    new = render_body(block, result["outputs"])
    out.update(outputs=result["outputs"], new=new)
    if same(block.body, new):
        return {**out, "status": "same"}
    return {**out, "status": "differs", "diff": diff_text(block.body, new, block.page)}


def apply(text: str, blocks: list[Block], judged: dict[str, dict[str, Any]], force: bool = False) -> str:
    """The page with every differing block's body (every run block's, with ``force``) replaced by its new body."""
    lines = text.split("\n")
    for block in sorted(blocks, key=lambda b: b.body_start, reverse=True):
        verdict = judged.get(block.id)
        if verdict and (verdict["status"] == "differs" or (force and "new" in verdict)):
            lines[block.body_start:block.body_end] = verdict["new"]
    return "\n".join(lines)


def select(targets: list[str]) -> tuple[list[str], dict[str, set[int]]]:
    """Pages to read, and for ``PAGE:LINE`` targets the marker lines to run on that page."""
    chosen: list[str] = []
    lines: dict[str, set[int]] = {}
    for target in targets:
        page, _, line = target.partition(":")
        page = str(Path(page).resolve().relative_to(ROOT)) if Path(page).is_absolute() else page
        if not (ROOT / page).is_file():
            raise SystemExit(f"error: page: got {page!r}, no such file under {ROOT}")
        if page not in chosen:
            chosen.append(page)
        if line:
            lines.setdefault(page, set()).add(int(line))
    return chosen, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="*", help="pages (README.md, docs/run.md) or PAGE:LINE; default every page")
    ap.add_argument("--check", action="store_true", help="compare only; write nothing")
    ap.add_argument("--json", type=Path, help="write per-block results to this file")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker()
        return 0
    chosen, only_lines = select(args.targets)
    texts = {page: (ROOT / page).read_text() for page in pages(chosen or None)}
    blocks: list[Block] = []
    for page, text in texts.items():
        found = parse_page(page, text)
        if page in only_lines:
            found = [b for b in found if b.line in only_lines[page]]
        blocks += found
    runnable = [b for b in blocks if not b.exempt]
    results = run_blocks(runnable, args.jobs)
    judged = {b.id: judge(b, results[b.id]) for b in runnable}
    for b in blocks:
        if b.exempt:
            judged[b.id] = {"id": b.id, "page": b.page, "line": b.line, "label": b.label, "status": "exempt",
                            "reason": b.exempt}
    bad = 0
    for page, text in texts.items():
        page_blocks = [b for b in blocks if b.page == page]
        for b in page_blocks:
            v = judged[b.id]
            if v["status"] == "error":
                bad += 1
                print(f"{b.label}: example failed: {v['error']}", file=sys.stderr)
            elif v["status"] == "differs":
                if args.check:
                    bad += 1
                    print(f"{b.label}: differs from the tool's output now\n{v['diff']}\n"
                          f"regenerate with: {v['regenerate']}", file=sys.stderr)
                else:
                    print(f"{b.label}: regenerated", file=sys.stderr)
        if not args.check:
            new = apply(text, page_blocks, judged)
            if new != text:
                (ROOT / page).write_text(new)
    if args.json:
        args.json.write_text(json.dumps({"blocks": list(judged.values())}, indent=1))
    counts = {s: sum(v["status"] == s for v in judged.values()) for s in ("same", "differs", "error", "exempt")}
    print(f"{len(blocks)} blocks on {len(texts)} pages: " + ", ".join(f"{n} {s}" for s, n in counts.items()),
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
