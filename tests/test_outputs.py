"""Outputs and what a run leaves behind: all outputs or none, no process and no temporary directory
after the run, and text that is safe to paste into a shell and to print on a terminal.

The matrix of outputs against inputs, and signals during a hung ``check``, are in tests/test_fuzz.py.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "fixtures" / "hostile" / "kernels.py"
ONE = "b1-h1kv1-tq1tk1-dh4dv4-none-rand-f32"
runner = CliRunner()
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self/stat").exists(),
                           reason="the subreaper and /proc are Linux's")


def digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def one_error_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.output[-1500:])
    return lines[0]


# --- all outputs or none -----------------------------------------------------------------------


@pytest.mark.parametrize("vanishes, field", [("html", "html"), ("output", "output")])
@pytest.mark.parametrize("before", ["absent", "present"])
def test_an_output_that_cannot_be_written_mid_run_leaves_every_output_path_as_it_was(
        tmp_path, monkeypatch, vanishes, field, before):
    """The directory of one output goes away after the report is built: exit 2 naming that output,
    and neither output path changed (the other one was ready to be written)."""
    import attn_ledger.render.html as page

    dirs = {"output": tmp_path / "out", "html": tmp_path / "ro"}
    for d in dirs.values():
        d.mkdir()
    out, html_path = dirs["output"] / "a.txt", dirs["html"] / "b.html"
    if before == "present":
        out.write_text("the report of yesterday\n")
        html_path.write_text("<p>the page of yesterday</p>\n")
    hashes = {p: digest(p) for p in (out, html_path)}
    real = page.render_html

    def render_then_lose_a_directory(*args, **kwargs):
        text = real(*args, **kwargs)
        gone = dirs[vanishes]
        gone.rename(tmp_path / "moved-away")  # as a directory made unwritable mid-run would refuse the write
        return text

    monkeypatch.setattr(page, "render_html", render_then_lose_a_directory)
    res = runner.invoke(app, ["run", "--fault", "no-scale", "--output", str(out), "--html", str(html_path)])
    assert one_error_line(res).startswith(f"error: {field}: got ")
    moved = tmp_path / "moved-away"
    for p, h in hashes.items():
        now = moved / p.name if p.parent == dirs[vanishes] else p
        assert digest(now) == h, p
    kept = next(d for k, d in dirs.items() if k != vanishes)
    assert [q.name for q in kept.iterdir() if q.name.endswith(".tmp")] == []  # no temporary file left there


def test_outputs_are_written_whole_and_together(tmp_path):
    out, page = tmp_path / "a.json", tmp_path / "b.html"
    res = runner.invoke(app, ["run", "--format", "json", "--output", str(out), "--html", str(page)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["verdict"] == "pass" and page.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.html"]


# --- nothing outlives the run ------------------------------------------------------------------


def run_cli(args: list[str], tmp: Path, **env: str) -> tuple[subprocess.Popen, dict[str, str]]:
    """The real CLI in a process of its own, with a private TMPDIR and a marker every process it
    starts inherits."""
    environ = {**os.environ, "TMPDIR": str(tmp), "ATTN_LEDGER_TEST_RUN": uuid.uuid4().hex, **env}
    environ.pop("ATTN_LEDGER_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "attn_ledger", *args], env=environ, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, environ


def marked(environ: dict[str, str]) -> list[int]:
    """The running processes that carry this run's marker (a zombie has no environment left to read)."""
    needle = f"ATTN_LEDGER_TEST_RUN={environ['ATTN_LEDGER_TEST_RUN']}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{name}/environ").read_bytes().split(b"\0"):
                found.append(int(name))
        except OSError:
            pass
    return found


def noted_pids(path: Path) -> list[int]:
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@LINUX
def test_a_setsid_grandchild_a_kernel_leaves_is_ended_before_the_report_is_renamed(tmp_path):
    """The kernel daemonizes a child (setsid, then a second fork) that would overwrite the report
    30 s later; after exit 0 it is gone, no process of the run remains, the report is the tool's
    and no temporary directory is left."""
    tmp, pids, report = tmp_path / "tmp", tmp_path / "pids", tmp_path / "report.json"
    tmp.mkdir()
    proc, environ = run_cli(["check", f"{KERNELS}:forks_setsid_child", "--case", ONE, "--format", "json",
                             "--output", str(report)], tmp, ATTN_LEDGER_TEST_PIDS=str(pids),
                            ATTN_LEDGER_TEST_SLEEP="30", ATTN_LEDGER_TEST_CLOBBER=str(report))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    daemon = noted_pids(pids)
    assert len(daemon) == 1, daemon  # it was started, and ran far enough to say so
    assert marked(environ) == []
    assert not Path(f"/proc/{daemon[0]}").exists()
    assert list(tmp.iterdir()) == []
    assert json.loads(report.read_text())["verdict"] == "pass"


@LINUX
def test_a_fork_server_killed_by_the_kernel_is_reported_as_such(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc, environ = run_cli(["check", f"{KERNELS}:kills_its_fork_server", "--case", ONE, "--format", "json",
                             "--timeout", "30"], tmp)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-2000:]
    call = next(c for c in json.loads(out)["rows"][0]["checks"] if c["name"] == "call")
    assert call["status"] == "fail" and "the fork server that started it died" in call["reason"], call
    assert "status 255" not in call["reason"]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]
    assert marked(environ) == [] and list(tmp.iterdir()) == []


# --- text safe to paste and to print -----------------------------------------------------------


HOSTILE_DIR, HOSTILE_FILE = "k", "b sp$(id).py"  # a shell runs `id` for an unquoted $(id)
WRONG_KERNEL = '''import torch.nn.functional as F


def attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allow_mask, is_causal=is_causal, scale=1.0)
'''
CASE = "b1-h1kv1-tq2tk3-dh4dv4-none-rand-f32"


@pytest.fixture
def hostile_kernel(tmp_path, monkeypatch) -> str:
    """A wrong kernel at ``k/b sp$(id).py``, named relative to the current directory, as in the issue."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / HOSTILE_DIR).mkdir()
    (tmp_path / HOSTILE_DIR / HOSTILE_FILE).write_text(WRONG_KERNEL)
    return f"{HOSTILE_DIR}/{HOSTILE_FILE}:attention"


def expected_argv(target: str) -> list[str]:
    return ["attn-ledger", "check", target, "--case", CASE]


def test_the_reproduction_line_is_quoted_in_the_table_json_html_and_pytest_message(hostile_kernel, tmp_path):
    target = hostile_kernel
    quoted = f"attn-ledger check {shlex.quote(target)} --case {CASE}"
    assert "'" in quoted  # shlex.quote had something to quote
    res = runner.invoke(app, ["check", target, "--case", CASE, "--format", "json", "--in-process",
                              "--html", "page.html"])
    assert res.exit_code == 1, res.output[-2000:]
    doc = json.loads(res.stdout)
    # JSON
    cli = doc["details"]["reproduce"]["cli"]
    assert cli == quoted and shlex.split(cli) == expected_argv(target)
    # HTML
    page = (tmp_path / "page.html").read_text()
    shown = [html.unescape(p.split(">", 1)[1].split("</pre>", 1)[0]) for p in page.split('<pre class="repro-cli"')[1:]]
    assert shown and all(shlex.split(s) == expected_argv(target) for s in shown), shown
    # the table: two lines joined by a shell continuation
    res = runner.invoke(app, ["check", target, "--case", CASE, "--in-process", "--output", "table.txt"])
    lines = (tmp_path / "table.txt").read_text().splitlines()
    at = lines.index("reproduce it:")
    assert lines[at + 1] == f"attn-ledger check {shlex.quote(target)} \\"
    assert shlex.split(lines[at + 1][:-1] + lines[at + 2]) == expected_argv(target)
    # the pytest helper's message
    from attn_ledger.testing import assert_attention_matches
    from attn_ledger.inputs.userload import load_object

    with pytest.raises(AssertionError) as caught:
        assert_attention_matches(load_object(target), CASE, name=target)
    line = next(ln.strip() for ln in str(caught.value).splitlines() if ln.strip().startswith("attn-ledger check"))
    assert shlex.split(line) == expected_argv(target)


def test_the_module_reproduction_line_is_quoted():
    from attn_ledger.testing import _module_reproduction

    spec = "m/b sp$(id).py:make"
    repro = _module_reproduction(spec, 12, 2, {"causal": True, "window": None, "scale": None, "seed": 0,
                                                "batch_size": 2, "seq_len": 6})
    assert shlex.split(repro["cli"])[:4] == ["attn-ledger", "check", "--module", spec]


def test_a_target_that_holds_the_case_option_still_splits_into_the_two_reproduction_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a --case b.py").write_text(WRONG_KERNEL)
    target = "a --case b.py:attention"
    res = runner.invoke(app, ["check", target, "--case", CASE, "--in-process", "--output", "t.txt"])
    assert res.exit_code == 1, res.output[-2000:]
    lines = (tmp_path / "t.txt").read_text().splitlines()
    at = lines.index("reproduce it:")
    assert shlex.split(lines[at + 1][:-1] + lines[at + 2]) == expected_argv(target)


@pytest.mark.parametrize("char, escaped", [("\n", "\\n"), ("\u202e", "\\u202e"), ("\x1b", "\\u001b"), ("\r", "\\r")],
                         ids=["newline", "rtl-override", "escape", "carriage-return"])
def test_control_and_bidi_characters_in_a_file_name_print_escaped_in_the_table(tmp_path, monkeypatch, char, escaped):
    monkeypatch.chdir(tmp_path)
    name = f"k{char}x.py"
    (tmp_path / name).write_text(WRONG_KERNEL)
    res = runner.invoke(app, ["check", f"{name}:attention", "--case", CASE, "--in-process", "--output", "t.txt"])
    assert res.exit_code == 1, res.output[-2000:]
    table = (tmp_path / "t.txt").read_text()
    if char != "\n":
        assert char not in table
    assert f"k{escaped}x.py" in table
    lines = table.splitlines()
    assert all(ln.count("'") % 2 == 0 for ln in lines if ln.startswith("attn-ledger check")), lines  # quotes close on their line
    # the JSON keeps the name as it is: its own escaping makes it one line
    res = runner.invoke(app, ["check", f"{name}:attention", "--case", CASE, "--in-process", "--format", "json"])
    assert json.loads(res.stdout)["details"]["target"] == f"{name}:attention"


def _hostile_report():
    from attn_ledger.report import Check, Report, Row

    bad = "a\u202eb\x1bc\nd"
    fail = Check(4, "reference", "fail", "max |out - ref|", 1.0, 0.1, "<=", reason=f"why {bad}")
    warn = Check(4, "precision", "warn", "ratio", 2.0, 1.5, "<=", reason=f"loose {bad}")
    return bad, Report("check", f"CHECK {bad}.py:attention", (Row(f"case {bad}", "fail", (fail, warn),
                                                                     note=f"picture\nline {bad}"),),
                       notes=(f"note {bad}",), unit="case")


@pytest.mark.parametrize("fmt", ["markdown", "github", "junit"])
def test_control_and_bidi_characters_print_escaped_in_markdown_github_and_junit(fmt):
    from xml.etree import ElementTree as ET

    from attn_ledger.render.github import render_github
    from attn_ledger.render.junit import render_junit
    from attn_ledger.render.markdown import render_markdown

    bad, report = _hostile_report()
    text = {"markdown": render_markdown, "github": render_github, "junit": render_junit}[fmt](report)
    assert "\u202e" not in text and "\x1b" not in text
    assert "a\\u202eb\\u001bc\\nd" in text  # as the JSON writes them
    if fmt == "markdown":  # one table row per row: a name's newline does not break it
        assert sum(ln.startswith("| case ") or ln.startswith("| `case") for ln in text.splitlines()) == 1
        assert "picture<br>line" in text  # a note's own line breaks are kept
    if fmt == "github":  # one annotation per line
        assert all(ln.startswith("::") for ln in text.splitlines()[:-1])
    if fmt == "junit":
        ET.fromstring(text.split("\n", 1)[1])  # well-formed XML: no raw control character


@pytest.mark.parametrize("fmt", ["markdown", "github", "junit"])
def test_a_file_name_with_a_bidi_override_prints_escaped_in_every_text_format(tmp_path, monkeypatch, fmt):
    monkeypatch.chdir(tmp_path)
    name = "k\u202ex.py"
    (tmp_path / name).write_text(WRONG_KERNEL)
    res = runner.invoke(app, ["check", f"{name}:attention", "--case", CASE, "--in-process", "--format", fmt])
    assert res.exit_code == 1, res.output[-2000:]
    assert "\u202e" not in res.stdout
    if fmt == "markdown":  # the title names the target (github and junit name the case only)
        assert "k\\u202ex.py" in res.stdout


def test_printable_escapes_controls_and_bidi_and_keeps_the_rest():
    from attn_ledger.render.text import printable

    assert printable("plain text, é, 日本, emoji \U0001F600") == "plain text, é, 日本, emoji \U0001F600"
    assert printable("a\tb\x00c\x7fd\u2066e\u2028") == "a\\tb\\u0000c\\u007fd\\u2066e\\u2028"
    assert printable("row 1\nrow 2", keep="\n") == "row 1\nrow 2"
