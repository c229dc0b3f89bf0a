"""The package's import graph against its floors (docs/architecture.md): arrows between floors, any that
point up or across a `` · ``, and loops.

    python scripts/imports.py          # floor -> floor arrow counts, then every wrong arrow and loop
    python scripts/imports.py --dot    # the graph of parts as Graphviz DOT, wrong arrows in red

Exit status 0 when every import points down (or stays on its floor) and there is no loop, 1 otherwise.
Imports are read from the source with ``ast``: those inside functions and under ``TYPE_CHECKING`` count.
``tests/test_layering.py`` runs the same functions.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attn_ledger"
PAGE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Place:
    floor: int  # 0 is the top (the face)
    group: int  # parts of one floor separated by '·' are groups that never import each other
    name: str


def floors(page: str) -> dict[str, Place]:
    """Part (``cli`` or ``commands/``) -> its place, from the table between the ``floors`` markers."""
    table = page.split("<!-- floors -->", 1)[1].split("<!-- /floors -->", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]
    parts: dict[str, Place] = {}
    for floor, row in enumerate(rows):
        name, cell = [c.strip() for c in row.strip("|").split("|")][:2]
        for group, chunk in enumerate(cell.split("·")):
            for part in re.findall(r"`([^`]+)`", chunk):
                assert part not in parts, f"{part} is listed twice"
                parts[part] = Place(floor, group, name)
    return parts


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def place_of(module: str, parts: dict[str, Place], package: Path = PACKAGE) -> Place:
    """The longest listed part that holds ``module``: ``probes/kernel/`` before ``probes/``."""
    rel = module.split(".")[1:] or ["__init__"]
    for n in range(len(rel), 0, -1):
        key = "/".join(rel[:n]) + ("/" if n < len(rel) or (package / "/".join(rel[:n])).is_dir() else "")
        if key in parts:
            return parts[key]
    raise AssertionError(f"{module} belongs to no floor of docs/architecture.md")


def _tree(path: Path) -> ast.AST:
    text = path.read_text()
    return _parsed(str(path), text)


@functools.lru_cache(maxsize=4096)
def _parsed(name: str, text: str) -> ast.AST:
    return ast.parse(text, name)


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) for every import of a package module, wherever it sits in the file."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # attn_ledger.x.y where y is a name, not a module
                target = target.rpartition(".")[0]
            if target and target != name and target != "attn_ledger":
                found.append((node.lineno, target))
    return found


def violations(package: Path = PACKAGE, page: str | None = None) -> list[str]:
    parts = floors(page if page is not None else PAGE.read_text())
    known = modules(package)
    wrong = []
    for name, path in known.items():
        here = place_of(name, parts, package)
        for line, target in imports(path, name, known):
            there = place_of(target, parts, package)
            where = f"{path.relative_to(package.parent)}:{line} imports {target}"
            if there.floor < here.floor:
                wrong.append(f"{where}: up from {here.name} to {there.name}")
            elif there.floor == here.floor and there.group != here.group:
                wrong.append(f"{where}: across the floor {here.name}, whose parts never import each other")
    return wrong


def loops(package: Path = PACKAGE) -> list[list[str]]:
    known = modules(package)
    graph = {name: sorted({t for _, t in imports(path, name, known)}) for name, path in known.items()}
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [node])
    return found


def _defined(path: Path) -> set[str]:
    """Top-level names a package's ``__init__`` defines (the root's lazy public names included)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if path.parent == PACKAGE:  # the root's lazy public names
        public = next(n for n in tree.body
                      if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_PUBLIC_BY_MODULE")
        names |= {name.value for _, listed in (entry.elts for entry in public.value.elts) for name in listed.elts}
    return names



def part_of(module: str, package: Path = PACKAGE) -> str:
    """The folder or root module a module sits in: ``probes/kernel/`` for ``attn_ledger.probes.kernel.check``."""
    rel = module.split(".")[1:] or ["__init__"]
    if len(rel) == 1 and not (package / rel[0]).is_dir():
        return rel[0]
    if rel[0] == "probes" and len(rel) >= 2 and (package / "probes" / rel[1]).is_dir():
        return f"probes/{rel[1]}/"
    return f"{rel[0]}/"


def arrows(package: Path = PACKAGE) -> Counter:
    """(from part, to part) -> how many imports."""
    known = modules(package)
    found: Counter = Counter()
    for name, path in known.items():
        for _, target in imports(path, name, known):
            a, b = part_of(name, package), part_of(target, package)
            if a != b:
                found[a, b] += 1
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dot", action="store_true", help="print the graph of parts as Graphviz DOT")
    args = parser.parse_args(argv)
    parts = floors(PAGE.read_text())
    wrong, cycles = violations(), loops()
    if args.dot:
        print("digraph attn_ledger {\n  rankdir=TB; node [shape=box];")
        for (a, b), n in sorted(arrows().items()):
            fa, fb = place_of(_module_of(a), parts), place_of(_module_of(b), parts)
            bad = fb.floor < fa.floor or (fb.floor == fa.floor and fb.group != fa.group)
            print(f'  "{a}" -> "{b}" [label={n}{", color=red" if bad else ""}];')
        print("}")
        return 1 if wrong or cycles else 0
    by_floor: Counter = Counter()
    for (a, b), n in arrows().items():
        fa, fb = place_of(_module_of(a), parts), place_of(_module_of(b), parts)
        by_floor[fa.name, fb.name] += n
    print(f"{len(modules())} modules, {sum(by_floor.values())} imports between parts")
    for (a, b), n in sorted(by_floor.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {a:>16} -> {b:<16} {n}")
    print(f"wrong arrows: {len(wrong)}")
    for line in wrong:
        print(f"  {line}")
    print(f"loops: {len(cycles)}")
    for cycle in cycles:
        print("  " + " -> ".join(cycle))
    return 1 if wrong or cycles else 0


def _module_of(part: str) -> str:
    return "attn_ledger." + part.rstrip("/").replace("/", ".")


if __name__ == "__main__":
    sys.exit(main())
