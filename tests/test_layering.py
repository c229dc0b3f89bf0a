"""The package's floors (docs/architecture.md): every import points down a floor or stays on its own, never
across a ``·`` within a floor, and the import graph has no loop (``scripts/imports.py`` prints it).

The table of floors is read from docs/architecture.md itself, so the page and the code cannot drift apart.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("attn_ledger_imports_script", ROOT / "scripts" / "imports.py")
graph = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = graph  # dataclasses look their module up there
_spec.loader.exec_module(graph)
PACKAGE, PAGE = graph.PACKAGE, graph.PAGE
floors, modules, place_of, violations, loops, _defined = (graph.floors, graph.modules, graph.place_of, graph.violations,
                                                           graph.loops, graph._defined)


def test_every_import_points_down_a_floor():
    assert violations() == []


def test_the_import_graph_has_no_loop():
    assert loops() == []


def test_every_part_the_page_lists_exists_and_every_module_has_a_floor():
    parts = floors(PAGE.read_text())
    for part in parts:
        path = PACKAGE / part if part.endswith("/") else PACKAGE / f"{part}.py"
        assert path.exists(), f"docs/architecture.md lists {part}, which is not in attn_ledger/"
    for name in modules():
        place_of(name, parts)


def test_the_root_holds_at_most_13_modules_besides_init():
    root = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(root) <= 13, sorted(root)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the package's sources to add wrong imports to."""
    shutil.copytree(PACKAGE, tmp_path / "attn_ledger", ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.typed"))
    return tmp_path / "attn_ledger"


@pytest.mark.parametrize("source, target, expected", [
    ("attn_ledger/maths/masks.py", "from attn_ledger.engine import plan", "up from maths and render to engine"),
    ("attn_ledger/probes/kernel/cases.py", "from attn_ledger.probes.module.check import check_module",
     "across the floor probe families"),
    ("attn_ledger/render/text.py", "import attn_ledger.maths.masks", "across the floor maths and render"),
    ("attn_ledger/report.py", "from attn_ledger.render.text import describe", "up from base to maths and render"),
])
def test_an_import_added_against_the_floors_is_named_and_removing_it_passes_again(copy, source, target, expected):
    path = copy.parent / source
    original = path.read_text()
    path.write_text(original + f"\n\ndef _added_for_the_test():\n    {target}\n")  # a lazy import counts too
    found = violations(copy)
    assert len(found) == 1 and expected in found[0] and source in found[0], found
    path.write_text(original)
    assert violations(copy) == []


def test_an_import_under_type_checking_counts(copy):
    path = copy / "maths" / "rotary.py"
    path.write_text(path.read_text() + "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from attn_ledger.ledger import run_ledger\n")
    found = violations(copy)
    assert len(found) == 1 and "maths/rotary.py" in found[0] and "imports attn_ledger.ledger" in found[0], found


def test_a_loop_is_found(copy):
    (copy / "seeding.py").write_text((copy / "seeding.py").read_text() + "\n\ndef _x():\n    from attn_ledger import alloc\n")
    (copy / "alloc.py").write_text((copy / "alloc.py").read_text() + "\n\ndef _y():\n    from attn_ledger import seeding\n")
    assert any({"attn_ledger.seeding", "attn_ledger.alloc"} <= set(loop) for loop in loops(copy))


def test_every_import_of_the_package_names_a_module_or_a_name_it_defines():
    """A stale path (``from attn_ledger.engine import inputs`` after it moved) would import through the old-path
    shim and warn; here it fails by name, wherever it hides (tests, scripts and fixtures included)."""
    known = modules()
    stale = []
    for path in sorted(p for d in ("attn_ledger", "tests", "scripts", "benchmarks", "fixtures") for p in (ROOT / d).rglob("*.py")):
        if path.name == "test_public.py":  # imports the old paths on purpose
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("attn_ledger"):
                if node.module not in known:
                    stale.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}")
                    continue
                init = known[node.module]
                if init.name == "__init__.py":
                    defined = _defined(init)
                    stale += [f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                              if f"{node.module}.{a.name}" not in known and a.name not in defined]
            elif isinstance(node, ast.Import):
                stale += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                          if a.name.startswith("attn_ledger") and a.name not in known]
    assert stale == []


def test_the_script_prints_the_floors_and_no_wrong_arrow():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "imports.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "wrong arrows: 0" in out.stdout and "loops: 0" in out.stdout and "probe families -> probe common" in out.stdout
