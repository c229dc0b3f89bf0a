"""No function in the package runs past 60 lines unless a comment beside it says why.

The reason goes on the ``def`` line or the line above it, as ``# long: <why>`` (or ``# long by ...``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60


def long_functions(package: Path = ROOT / "attn_ledger") -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                said = any("# long" in lines[i - 1] for i in (first - 1, node.lineno) if i >= 1)
                if length > LIMIT and not said:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} {node.name} is {length} lines")
    return found


def test_no_function_passes_60_lines_without_a_reason_beside_it():
    assert long_functions() == []


def test_a_long_function_is_found_and_a_reason_lets_it_be(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(f"def too_long():\n{body}\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:1 too_long is {LIMIT + 1} lines"]
    (tmp_path / "m.py").write_text(f"# long: one flat table of assignments\ndef too_long():\n{body}\n")
    assert long_functions(tmp_path) == []
