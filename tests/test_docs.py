"""The documentation against the tool: every example in README.md and docs/ runs and matches its page.

One subprocess (``scripts/docs.py --check``, two worker processes, one thread each,
``MKL_ENABLE_INSTRUCTIONS=AVX2``) runs every marked example and regenerates every generated
table; each block is then one test here, which fails with the difference and the command that
regenerates the page. Values below 1e-5 are masked (they vary with the CPU's instruction set),
paths and whitespace normalised, every other number compared exactly.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("run", "check", "faults", "sweep-scale", "polarity", "intervene", "scan", "compare")
PAGES = ("run", "check", "check-decode", "faults", "sweep-scale", "polarity", "intervene", "scan", "compare", "json", "ci",
         "performance", "library")


def _load_script():
    spec = importlib.util.spec_from_file_location("attn_ledger_docs_script", ROOT / "scripts" / "docs.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


D = _load_script()
ALL_PAGES = D.pages()
BLOCKS = [b for page in ALL_PAGES for b in D.parse_page(page, (ROOT / page).read_text())]
RUNNABLE = [b for b in BLOCKS if not b.exempt]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("docs") / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs.py"), "--check", "--jobs", "2",
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    if not out.exists():
        pytest.fail(f"scripts/docs.py --check wrote no results (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {r["id"]: r for r in json.loads(out.read_text())["blocks"]}


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_example_matches_what_the_tool_prints(results, block):
    r = results[block.id]
    if r["status"] == "error":
        pytest.fail(f"{r['label']}: the example does not run as written:\n{r['error']}\n"
                    f"fix the example (or the tool), then: {r['regenerate']}", pytrace=False)
    if r["status"] == "differs":
        pytest.fail(f"{r['label']}: the page differs from what the tool prints now\n{r['diff']}\n"
                    f"regenerate the page with: {r['regenerate']}", pytrace=False)
    assert r["status"] == "same"


def test_regenerating_twice_changes_nothing(results):
    """Writing every regenerated block, then regenerating from that page, is a fixed point."""
    for page in ALL_PAGES:
        text = (ROOT / page).read_text()
        blocks = D.parse_page(page, text)
        once = D.apply(text, blocks, results, force=True)
        again = D.parse_page(page, once)
        assert [b.id for b in again] == [b.id for b in blocks], page  # no block moved or vanished
        for b in again:
            r = results.get(b.id)
            if r and "outputs" in r:
                assert D.render_body(b, r["outputs"]) == b.body, b.label
        # the script itself rewrites only blocks that differ: a matching page is left byte for byte
        if all(results[b.id]["status"] in ("same", "exempt") for b in blocks):
            assert D.apply(text, blocks, results) == text, page


# --- the comparison: what counts as a change ----------------------------------------------

BODY = ["scores          fail    (2, 3, 5, 5)   L4 fail matches_reference = 1.62 (rtol 2e-05, atol",
        "                                         2e-05)",
        "context         pass    (2, 3, 5, 4)   L4 pass matches_sdpa = 1.19e-07"]


def test_one_changed_number_is_a_difference():
    edited = [BODY[0].replace("1.62", "1.63"), *BODY[1:]]
    assert not D.same(BODY, edited)
    assert not D.same(BODY, [BODY[0].replace("(2, 3, 5, 5)", "(2, 3, 5, 6)"), *BODY[1:]])
    assert not D.same(BODY, [BODY[0].replace("fail matches", "pass matches"), *BODY[1:]])
    assert "1.63" in D.diff_text(BODY, edited, "docs/x.md")


def test_rounding_level_values_paths_and_wrapping_are_not():
    assert D.same(BODY, [*BODY[:2], BODY[2].replace("1.19e-07", "5.96e-08")])
    assert D.same(BODY, [*BODY[:2], BODY[2].replace("1.19e-07", "0")])
    rewrapped = [BODY[0] + " " + BODY[1].strip(), BODY[2].replace("    ", "  ")]
    assert D.same(BODY, rewrapped)
    assert D.same([f"{ROOT}/fixtures/a.py"], ["./fixtures/a.py"])
    assert not D.same(["2.0e-05"], ["3.0e-05"])  # 1e-5 and above are compared exactly


def test_markers_name_only_the_allowed_exemptions():
    with pytest.raises(D.PageError, match="exempt"):
        D.parse_page("x.md", "<!-- example exempt=slow -->\n```console\n$ attn-ledger run\n```\n")
    with pytest.raises(D.PageError, match="unknown marker option"):
        D.parse_page("x.md", "<!-- example colour=red -->\n```console\n$ attn-ledger run\n```\n")
    assert {b.exempt for b in BLOCKS} <= {None, *D.EXEMPT_REASONS}


def test_every_example_on_a_page_is_marked():
    """A transcript (``$ `` or ``>>> `` lines) in a fence without a marker would go stale unseen."""
    for page in ALL_PAGES:
        lines = (ROOT / page).read_text().split("\n")
        marked = {b.body_start - 1 for b in BLOCKS if b.page == page}
        fence = None
        for i, line in enumerate(lines):
            m = D.FENCE.match(line)
            if m and fence is None:
                fence = (i, m.group(1))
            elif fence is not None and line.strip() == fence[1]:
                body = lines[fence[0] + 1:i]
                if any(x.startswith(("$ ", ">>> ")) for x in body):
                    assert fence[0] in marked, f"{page}:{fence[0] + 1}: an example without a marker"
                fence = None


def test_prose_quotes_of_check_lines_appear_in_the_page_output():
    """A check line quoted in the prose (`L2 fail roundtrip_exact = 96 (limit 0)`) is one the page prints."""
    for page in ALL_PAGES:
        text = (ROOT / page).read_text()
        printed = "\n".join("\n".join(b.body) for b in BLOCKS if b.page == page)
        prose = re.sub(r"(?ms)^(```|~~~).*?^\1", "", text)
        for quote in re.findall(r"`(L[1-4] (?:pass|fail|warn) [^`]+)`", prose):
            assert quote in printed, f"{page}: the prose quotes `{quote}`, which no example on the page prints"


# --- pages, commands and options ----------------------------------------------------------

def test_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 320  # the check example names each bound's parts (c, eps, M) since the rounding rule
    for name in PAGES:
        assert f"(docs/{name}.md)" in readme, name
    for cmd in COMMANDS:
        assert f"`attn-ledger {cmd}`" in readme, cmd


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_page_naming_every_option(command):
    import typer.main

    from attn_ledger.cli import app

    page = (ROOT / "docs" / f"{command}.md").read_text()
    assert page.startswith(f"# `attn-ledger {command}`")
    assert any(b.page == f"docs/{command}.md" and b.kind == "console" and not b.exempt
               and any(i.startswith(f"attn-ledger {command}") for i in b.inputs) for b in BLOCKS), command
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    for param in cmd.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("--") and opt != "--help":
                assert opt in page, f"docs/{command}.md does not name {opt}"


def test_check_page_names_every_kernel_check_and_the_protocol():
    from attn_ledger.probes.kernel.check import CHECK_ORDER

    page = (ROOT / "docs" / "check.md").read_text()
    for _, name in CHECK_ORDER:
        assert f"`{name}`" in page, name
    assert "def attention(q, k, v, *, allow_mask=None, is_causal=False, scale=None) -> Tensor" in page


def test_json_page_names_every_field_of_the_schema():
    from attn_ledger.render.jsondoc import schema

    page = (ROOT / "docs" / "json.md").read_text()
    doc = schema()
    for field in doc["properties"]:
        assert f"`{field}`" in page, field
    for name in ("row", "check", "finding", "coverage"):
        for field in doc["$defs"][name]["properties"]:
            assert f"`{field}`" in page, (name, field)
    assert f"`schema_version` is {doc['properties']['schema_version']['const']}" in page


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_between_pages_resolve():
    for page in ALL_PAGES:
        path = ROOT / page
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{page}: link to {target}: no such file"
            if anchor and dest.suffix == ".md":
                prose = re.sub(r"(?ms)^(```|~~~).*?^\1", "", dest.read_text())
                slugs = {_slug(h) for h in re.findall(r"(?m)^#+ (.+)$", prose)}
                assert anchor in slugs, f"{page}: link to {target}: no such heading"
